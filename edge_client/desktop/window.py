"""The main window: conversations on the left, the chat in the middle, settings and stats on the right.

The window owns the conversation file and does all its writing; the worker
(worker.py) owns the network and the models. An answer's row is written when
it starts and rewritten as it streams (at most every `flush_interval_ms`), so
whatever happens next, what was shown is on disk.
"""

from __future__ import annotations

import dataclasses
import pathlib

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QCloseEvent
from PySide6.QtWidgets import QMainWindow, QProgressBar, QSplitter, QVBoxLayout, QWidget

from specedge.edge_client.desktop import stats as figures
from specedge.edge_client.desktop import worker as outcomes
from specedge.edge_client.desktop.collector import GuiThreadCollector
from specedge.edge_client.desktop.settings import ChatSettings, load_settings, save_settings
from specedge.edge_client.desktop.settings_panel import SettingsPanel
from specedge.edge_client.desktop.store import DEFAULT_TITLE, DONE, INTERRUPTED, STOPPED, STREAMING, ChatStore, history
from specedge.edge_client.desktop.transcript import Transcript
from specedge.edge_client.desktop.widgets import Composer, ConnectionBar, ConversationList, ErrorBanner, StatsPanel
from specedge.edge_client.desktop.worker import EdgeWorker, State, WorkerConfig

STORED_STATUS = {
    outcomes.DONE: DONE,
    outcomes.STOPPED: STOPPED,
    outcomes.INTERRUPTED: INTERRUPTED,
    outcomes.FAILED: INTERRUPTED,
}


@dataclasses.dataclass(frozen=True)
class DesktopConfig:
    data_dir: pathlib.Path  # holds chat.sqlite3: conversations and remembered settings
    worker: WorkerConfig = WorkerConfig()
    settings: ChatSettings | None = None  # given on the command line; None: the remembered ones
    flush_interval_ms: int = 100  # how often a streaming answer is redrawn and written

    def __post_init__(self):
        if self.flush_interval_ms < 1:
            raise ValueError(f"flush_interval_ms must be >= 1, got {self.flush_interval_ms}")


@dataclasses.dataclass
class _Answer:
    id: int
    conversation_id: int
    text: str = ""
    samples: list = dataclasses.field(default_factory=list)  # (seconds, tokens so far), for the chart
    live: dict = dataclasses.field(default_factory=dict)


class MainWindow(QMainWindow):
    answer_ended = Signal(int, str)  # answer id, outcome (worker.DONE, ...): for whoever waits on an answer

    def __init__(self, config: DesktopConfig):
        super().__init__()
        self.config = config
        self.store = ChatStore(pathlib.Path(config.data_dir) / "chat.sqlite3")
        self._closed = False  # the window has gone: late signals from the worker are dropped
        self.store.recover()
        self.settings = config.settings or load_settings(self.store)
        save_settings(self.store, self.settings)
        self.current: int | None = None
        self.answer: _Answer | None = None
        self.state = State.CONNECTING
        self._collector = GuiThreadCollector(self)  # before the worker's thread exists (collector.py says why)
        self.worker = EdgeWorker(config.worker)
        self._flush_timer = QTimer(self, singleShot=True, interval=config.flush_interval_ms)
        self._flush_timer.timeout.connect(self._flush)
        self._build()
        self._wire()
        self._load_conversations()
        self.worker.connect(self.settings)

    # -- layout ------------------------------------------------------------

    def _build(self) -> None:
        self.setWindowTitle("SpecEdge Chat")
        self.conversations = ConversationList()
        self.connection = ConnectionBar()
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.hide()
        self.error = ErrorBanner()
        self.transcript = Transcript()
        composer = Composer()
        self.input, self.send_button, self.stop_button, self.regenerate_button = (
            composer.input,
            composer.send_button,
            composer.stop_button,
            composer.regenerate_button,
        )
        chat = QWidget()
        column = QVBoxLayout(chat)
        for widget in (self.connection, self.progress, self.error):
            column.addWidget(widget)
        column.addWidget(self.transcript, 1)
        column.addWidget(composer)
        self.settings_panel = SettingsPanel(self.settings)
        self.stats = StatsPanel()
        side = QWidget()
        side_column = QVBoxLayout(side)
        side_column.addWidget(self.settings_panel)
        side_column.addWidget(self.stats, 1)
        splitter = QSplitter(Qt.Orientation.Horizontal)
        for pane in (self.conversations, chat, side):
            splitter.addWidget(pane)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([190, 620, 290])
        self.setCentralWidget(splitter)
        self.resize(1100, 680)

    def _wire(self) -> None:
        signals = self.worker.signals
        signals.state.connect(self._on_state)
        signals.progress.connect(self._on_progress)
        signals.delta.connect(self._on_delta)
        signals.finished.connect(self._on_finished)
        self.input.submitted.connect(self.send)
        self.send_button.clicked.connect(self.send)
        self.stop_button.clicked.connect(self.worker.stop)
        self.regenerate_button.clicked.connect(self.regenerate)
        self.connection.reconnect_button.clicked.connect(self.worker.reconnect)
        self.settings_panel.applied.connect(self.apply_settings)
        self.conversations.new_button.clicked.connect(lambda: self.select(self.store.new_conversation()))
        self.conversations.renamed.connect(self.rename_conversation)
        self.conversations.deleted.connect(self.delete_conversation)
        self.conversations.list.currentItemChanged.connect(
            lambda item, _: self.select(item.data(Qt.ItemDataRole.UserRole)) if item is not None else None
        )

    # -- conversations -----------------------------------------------------

    def _load_conversations(self) -> None:
        listed = self.store.conversations()
        self.select(listed[0].id if listed else self.store.new_conversation())

    def select(self, conversation_id: int) -> None:
        self.current = conversation_id
        self.conversations.fill(self.store.conversations(), conversation_id)
        messages = self.store.messages(conversation_id)
        self.transcript.show_messages(messages)
        answers = [m for m in messages if m.role == "assistant"]
        if self.answer is not None and self.answer.conversation_id == conversation_id:
            self.transcript.update_last_answer(self.answer.text)  # the file may lag the screen by a flush
            self._show_answer_figures(self.answer.live, self.answer.samples)
        else:
            last = answers[-1].stats if answers and answers[-1].stats else {}
            self.stats.answer.show_figures(last)
            self.stats.chart.set_values(last.get("series", []))
        self.stats.overall.show_figures(figures.overall(self.store.all_answer_stats()))
        self._update_buttons()

    def rename_conversation(self, conversation_id: int, title: str) -> None:
        self.store.rename(conversation_id, title)
        self.conversations.fill(self.store.conversations(), self.current)

    def delete_conversation(self, conversation_id: int) -> None:
        if self.answer is not None and self.answer.conversation_id == conversation_id:
            self.worker.stop()
        self.store.delete_conversation(conversation_id)
        if conversation_id == self.current:
            self._load_conversations()
        else:
            self.conversations.fill(self.store.conversations(), self.current)

    # -- chatting ----------------------------------------------------------

    def send(self) -> None:
        text = self.input.toPlainText().strip()
        current = self._conversation_to_ask()
        if not text or current is None:
            return
        if self.store.title(current) == DEFAULT_TITLE:
            self.store.rename(current, text.splitlines()[0][:40])
        self.store.add_message(current, "user", text)
        self.input.clear()
        self._ask(current)

    def regenerate(self) -> None:
        """Answer the last user turn again (the previous answer to it is replaced)."""
        current = self._conversation_to_ask()
        if current is None:
            return
        messages = self.store.messages(current)
        if messages and messages[-1].role == "assistant":
            self.store.delete_message(messages[-1].id)
            messages = messages[:-1]
        if messages and messages[-1].role == "user":
            self._ask(current)

    def _conversation_to_ask(self) -> int | None:
        """The open conversation, if a question can be put to it now (connected, no answer being written)."""
        return self.current if self.answer is None and self.state is State.CONNECTED else None

    def _ask(self, conversation_id: int) -> None:
        self.error.hide()
        self._take_sampling_settings()
        prompt = history(self.store.messages(conversation_id))
        answer_id = self.store.add_message(conversation_id, "assistant", "", STREAMING)
        self.answer = _Answer(answer_id, conversation_id)
        self.select(conversation_id)
        self.worker.ask(answer_id, conversation_id, prompt, self.settings.policy(self.config.worker.policy))

    def _take_sampling_settings(self) -> None:
        """Temperature and max tokens apply from the next answer on, without reconnecting."""
        form = self.settings_panel
        self.settings = dataclasses.replace(
            self.settings, temperature=round(form.temperature.value(), 2), max_tokens=form.max_tokens.value()
        )
        save_settings(self.store, self.settings)

    def apply_settings(self, settings: ChatSettings) -> None:
        reconnect = settings.connection() != self.settings.connection() or self.state is not State.CONNECTED
        self.settings = settings
        save_settings(self.store, settings)
        if reconnect:
            self.worker.connect(settings)

    # -- from the worker ---------------------------------------------------

    def _on_state(self, state: str, detail: str) -> None:
        if self._closed:
            return  # queued before the window closed
        self.state = State(state)
        self.connection.show_state(self.state, detail)
        if self.state is not State.PREPARING:
            self.progress.hide()
        self._update_buttons()

    def _on_progress(self, what: str, done: int, total: int) -> None:
        if self._closed:
            return  # queued before the window closed
        self.progress.setFormat(f"Assembling the draft model {what}: %p%")
        self.progress.setValue(int(1000 * done / total) if total else 1000)
        self.progress.setVisible(done < total)

    def _on_delta(self, answer_id: int, text: str, live: dict) -> None:
        if self._closed:
            return  # queued before the window closed
        if self.answer is None or self.answer.id != answer_id:
            return
        self.answer.text += text
        self.answer.live = live
        self.answer.samples.append((live["elapsed_s"], live["num_tokens"]))
        if not self._flush_timer.isActive():
            self._flush_timer.start()

    def _flush(self) -> None:
        answer = self.answer
        if answer is None or self._closed:
            return
        self.store.write_answer(answer.id, answer.text, STREAMING)
        if answer.conversation_id == self.current:
            self.transcript.update_last_answer(answer.text)
            self._show_answer_figures(answer.live, answer.samples)

    def _show_answer_figures(self, live: dict, samples: list) -> None:
        self.stats.answer.show_figures(live)
        self.stats.chart.set_values(figures.rate_series(samples, live.get("elapsed_s", 0.0)))

    def _on_finished(self, answer_id: int, outcome: str, data: dict | None, message: str, text: str) -> None:
        if self._closed:
            return  # queued before the window closed
        answer = self.answer
        if message:
            self.error.say(message)
        if answer is None or answer.id != answer_id:
            return
        self._flush_timer.stop()
        self.answer = None
        answer.text = text
        if outcome == outcomes.FAILED and not answer.text:
            self.store.delete_message(answer.id)  # nothing was written: the error banner says why
        else:
            self.store.write_answer(answer.id, answer.text, STORED_STATUS[outcome], data)
        if answer.conversation_id == self.current:
            self.select(self.current)
        self.answer_ended.emit(answer_id, outcome)

    def _update_buttons(self) -> None:
        idle = self.answer is None
        connected = self.state is State.CONNECTED
        self.send_button.setEnabled(idle and connected)
        self.stop_button.setEnabled(not idle)
        messages = self.store.messages(self.current) if self.current is not None else []
        self.regenerate_button.setEnabled(idle and connected and any(m.role == "user" for m in messages))

    def closeEvent(self, event: QCloseEvent) -> None:
        if self._closed:  # closed before
            return super().closeEvent(event)
        if self.answer is not None:  # closed mid-answer: keep what was written, marked
            self.store.write_answer(self.answer.id, self.answer.text, INTERRUPTED)
            self.answer = None
        self.worker.signals.blockSignals(True)  # nothing may reach the window while it goes
        self._flush_timer.stop()
        self.worker.shutdown()
        self.store.close()
        self._collector.close()
        self._closed = True
        super().closeEvent(event)
