"""The conversation as a document: user turns as typed, answers rendered as Markdown with shaded code blocks.

A streaming answer is redrawn in place: the document remembers where the
last answer's body starts, and each update replaces only that tail, so a long
conversation costs no more to stream into than a short one. Unfinished
Markdown (an open code fence) renders as it stands and settles as it closes.
"""

from __future__ import annotations

from PySide6.QtGui import QColor, QFont, QTextBlockFormat, QTextCharFormat, QTextCursor, QTextFormat
from PySide6.QtWidgets import QTextBrowser, QWidget

from specedge.edge_client.desktop.store import DONE, INTERRUPTED, STOPPED, STREAMING, Message

MARKERS = {INTERRUPTED: "[interrupted]", STOPPED: "[stopped]", STREAMING: "..."}
CODE_BACKGROUND = QColor("#f3f4f6")
ROLE_COLORS = {"user": QColor("#1f6feb"), "assistant": QColor("#8250df")}


class Transcript(QTextBrowser):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setOpenExternalLinks(True)
        self.document().setDocumentMargin(12)
        self._tail: int | None = None  # document position where the last answer's body starts
        self.assistant_name = "Assistant"

    def show_messages(self, messages: list[Message]) -> None:
        """Redraw the whole conversation (switching chats, or after an edit)."""
        self.clear()
        self._tail = None
        cursor = QTextCursor(self.document())
        for index, message in enumerate(messages):
            self._heading(cursor, message.role, first=index == 0)
            if message.role == "assistant":
                self._tail = cursor.position()
                self._body(cursor, message.content, message.status)
            else:
                self._plain(cursor, message.content)
        self._scroll_to_end()

    def update_last_answer(self, text: str, status: str = STREAMING) -> None:
        """Replace the last answer's body (it must be the last message shown)."""
        if self._tail is None:
            return
        cursor = QTextCursor(self.document())
        cursor.setPosition(self._tail)
        cursor.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()
        self._body(cursor, text, status)
        self._scroll_to_end()

    def _heading(self, cursor: QTextCursor, role: str, first: bool) -> None:
        if not first:
            cursor.insertBlock(QTextBlockFormat())
        block = QTextBlockFormat()
        block.setTopMargin(0 if first else 14)
        fmt = QTextCharFormat()
        fmt.setFontWeight(QFont.Weight.Bold)
        fmt.setForeground(ROLE_COLORS[role])
        cursor.setBlockFormat(block)
        cursor.setCharFormat(fmt)
        cursor.insertText("You" if role == "user" else self.assistant_name)
        cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())

    def _plain(self, cursor: QTextCursor, text: str) -> None:
        cursor.insertText(text, QTextCharFormat())

    def _body(self, cursor: QTextCursor, text: str, status: str) -> None:
        start = cursor.position()
        if text:
            cursor.insertMarkdown(text)
        _shade_code_blocks(self.document(), start, cursor.position())
        if status != DONE:
            marker = QTextCharFormat()
            marker.setFontItalic(True)
            marker.setForeground(QColor("#6b7280"))
            cursor.movePosition(QTextCursor.MoveOperation.End)
            if text:
                cursor.insertBlock(QTextBlockFormat())
            cursor.insertText(MARKERS[status], marker)

    def _scroll_to_end(self) -> None:
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())


def _shade_code_blocks(document, start: int, end: int) -> None:
    """Give fenced code blocks a background, which Qt's Markdown import leaves plain."""
    block = document.findBlock(start)
    while block.isValid() and block.position() <= end:
        fmt = block.blockFormat()
        if fmt.hasProperty(QTextFormat.Property.BlockCodeFence) or fmt.hasProperty(
            QTextFormat.Property.BlockCodeLanguage
        ):
            fmt.setBackground(CODE_BACKGROUND)
            fmt.setLeftMargin(8)
            QTextCursor(block).setBlockFormat(fmt)
        block = block.next()
