"""The window's smaller parts: input box, conversation list, connection bar, stats panel and sparkline."""

from __future__ import annotations

from collections.abc import Sequence

from PySide6.QtCore import QPointF, Qt, Signal
from PySide6.QtGui import QColor, QKeyEvent, QPainter, QPainterPath, QPen
from PySide6.QtWidgets import (
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QMessageBox,
    QPlainTextEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from specedge.edge_client.desktop import stats as figures
from specedge.edge_client.desktop.store import ConversationInfo
from specedge.edge_client.desktop.worker import State


class ChatInput(QPlainTextEdit):
    """Enter sends, Shift+Enter starts a new line."""

    submitted = Signal()

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setPlaceholderText("Message (Enter sends, Shift+Enter for a new line)")
        self.setFixedHeight(72)

    def keyPressEvent(self, event: QKeyEvent) -> None:
        enter = event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter)
        if enter and not event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self.submitted.emit()
            return
        super().keyPressEvent(event)


class Composer(QWidget):
    """The input box with Send, Stop and Regenerate beside it."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.input = ChatInput()
        self.send_button, self.stop_button, self.regenerate_button = (
            QPushButton("Send"),
            QPushButton("Stop"),
            QPushButton("Regenerate"),
        )
        buttons = QVBoxLayout()
        for button in (self.send_button, self.stop_button, self.regenerate_button):
            buttons.addWidget(button)
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.input, 1)
        row.addLayout(buttons)


class ErrorBanner(QLabel):
    """The last error, in plain words, above the conversation; hidden until there is one."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWordWrap(True)
        self.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.setStyleSheet("background: #fdecea; color: #8a1c1c; padding: 6px; border-radius: 4px")
        self.hide()

    def say(self, message: str) -> None:
        self.setText(message)
        self.show()


class ConversationList(QWidget):
    """The side list with New, Rename and Delete; items carry the conversation id.

    Rename and Delete ask the user first (a title, a confirmation), then say what to do by a signal.
    """

    renamed = Signal(int, str)  # conversation id, new title
    deleted = Signal(int)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.list = QListWidget()
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)  # long titles are elided
        self.new_button, self.rename_button, self.delete_button = (
            QPushButton("New"),
            QPushButton("Rename"),
            QPushButton("Delete"),
        )
        buttons = QHBoxLayout()
        for button in (self.new_button, self.rename_button, self.delete_button):
            buttons.addWidget(button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.list, 1)
        layout.addLayout(buttons)
        self.rename_button.clicked.connect(self._ask_rename)
        self.delete_button.clicked.connect(self._ask_delete)

    def fill(self, conversations: Sequence[ConversationInfo], current: int | None) -> None:
        self.list.blockSignals(True)  # refilling is not the user choosing a chat
        self.list.clear()
        for info in conversations:
            item = QListWidgetItem(info.title)
            item.setData(Qt.ItemDataRole.UserRole, info.id)
            self.list.addItem(item)
            if info.id == current:
                self.list.setCurrentItem(item)
        self.list.blockSignals(False)

    def ids(self) -> list[int]:
        return [self.list.item(row).data(Qt.ItemDataRole.UserRole) for row in range(self.list.count())]

    def _ask_rename(self) -> None:
        item = self.list.currentItem()
        if item is not None:
            title, ok = QInputDialog.getText(self, "Rename chat", "Title:", text=item.text())
            if ok:
                self.renamed.emit(item.data(Qt.ItemDataRole.UserRole), title)

    def _ask_delete(self) -> None:
        item = self.list.currentItem()
        if item is not None:
            sure = QMessageBox.question(self, "Delete chat", f"Delete \u201c{item.text()}\u201d and its messages?")
            if sure == QMessageBox.StandardButton.Yes:
                self.deleted.emit(item.data(Qt.ItemDataRole.UserRole))


STATE_COLORS = {
    State.PREPARING: "#9a6700",
    State.CONNECTING: "#9a6700",
    State.CONNECTED: "#1a7f37",
    State.INCOMPATIBLE: "#b00020",
    State.REFUSED: "#b00020",
    State.OFFLINE: "#b00020",
    State.ERROR: "#b00020",
}
STATE_WORDS = {
    State.PREPARING: "Preparing",
    State.CONNECTING: "Connecting",
    State.CONNECTED: "Connected",
    State.INCOMPATIBLE: "Incompatible draft",
    State.REFUSED: "Refused",
    State.OFFLINE: "Offline",
    State.ERROR: "Cannot start",
}


class ConnectionBar(QWidget):
    """Always-visible connection state: a coloured dot, what it means in words, and Reconnect."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.dot = QLabel("\u25cf")
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.reconnect_button = QPushButton("Reconnect")
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.dot)
        layout.addWidget(self.label, 1)
        layout.addWidget(self.reconnect_button)
        self.state = State.CONNECTING
        self.show_state(State.CONNECTING, "")

    def show_state(self, state: State, detail: str) -> None:
        self.state = state
        self.dot.setStyleSheet(f"color: {STATE_COLORS[state]}")
        self.label.setText(f"{STATE_WORDS[state]}: {detail}" if detail else STATE_WORDS[state])
        self.reconnect_button.setVisible(state in (State.OFFLINE, State.INCOMPATIBLE, State.REFUSED, State.ERROR))


class Sparkline(QWidget):
    """Tokens/s over the answer: a small filled line, the peak written in the corner."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.values: list[float] = []
        self.setMinimumHeight(56)

    def set_values(self, values: Sequence[float]) -> None:
        self.values = list(values)
        self.update()

    def paintEvent(self, event) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        rect = self.rect().adjusted(2, 14, -2, -2)
        painter.fillRect(self.rect(), QColor("#fafafa"))
        peak = max(self.values, default=0.0)
        painter.setPen(QColor("#6b7280"))
        painter.drawText(
            self.rect().adjusted(4, 0, -4, 0),
            Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft,
            f"tokens/s, peak {peak:.3g}" if peak else "tokens/s",
        )
        if len(self.values) < 2 or peak <= 0:
            return
        step = rect.width() / (len(self.values) - 1)
        points = [
            QPointF(rect.left() + i * step, rect.bottom() - v / peak * rect.height()) for i, v in enumerate(self.values)
        ]
        area = QPainterPath(QPointF(rect.left(), rect.bottom()))
        for point in points:
            area.lineTo(point)
        area.lineTo(QPointF(rect.right(), rect.bottom()))
        painter.fillPath(area, QColor(130, 80, 223, 60))
        painter.setPen(QPen(QColor("#8250df"), 1.5))
        painter.drawPolyline(points)


class FiguresBox(QGroupBox):
    """(label, value) rows from stats.describe, updated in place."""

    def __init__(self, title: str, empty: dict, parent: QWidget | None = None):
        super().__init__(title, parent)
        self.form = QFormLayout(self)
        self.values: dict[str, QLabel] = {}
        self.show_figures(empty)

    def show_figures(self, data: dict) -> None:
        for label, value in figures.describe(data):
            if label not in self.values:
                self.values[label] = QLabel()
                self.values[label].setWordWrap(True)
                self.form.addRow(label, self.values[label])
            self.values[label].setText(value)


class StatsPanel(QWidget):
    """This answer's figures (live while it streams) with its tokens/s chart, and all answers' together."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.answer = FiguresBox("This answer", {})
        self.chart = Sparkline()
        self.answer.form.addRow(self.chart)
        self.overall = FiguresBox("All answers", figures.overall([]))
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.answer)
        layout.addWidget(self.overall)
        layout.addStretch(1)
