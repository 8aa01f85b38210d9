"""The remembered settings: server address, draft model, temperature, max tokens.

They live in the conversation file's settings table (one JSON value), so a
data directory carries everything the app remembers. A stored value that no
longer validates (hand-edited, or from an older version) falls back to the
defaults field by field rather than stopping the app.
"""

from __future__ import annotations

import dataclasses
import json

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QWidget,
)

from specedge.edge_client.client import EdgeConfig
from specedge.registry import BUILTINS
from specedge.types import SamplingParams

SETTINGS_KEY = "chat_settings"
MAX_TOKENS_LIMIT = 32768


@dataclasses.dataclass(frozen=True)
class ChatSettings:
    server: str = "127.0.0.1:50051"  # HOST:PORT of specedge-server
    draft: str = "qwen2.5-coder-0.5b"  # built-in name, .gguf file or HF directory (also the tokenizer)
    temperature: float = 0.0  # 0: greedy, token-identical to the server alone
    max_tokens: int = 1024  # per answer
    server_only: bool = False  # no drafting: the server generates alone (the baseline)

    def __post_init__(self):
        host, _, port = self.server.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"server address must be HOST:PORT, got {self.server!r}")
        if not self.draft.strip():
            raise ValueError("choose a draft model: a built-in name or a .gguf file")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be between 0 and 2, got {self.temperature}")
        if not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise ValueError(f"max tokens must be between 1 and {MAX_TOKENS_LIMIT}, got {self.max_tokens}")

    def edge_config(self, base: EdgeConfig) -> EdgeConfig:
        """`base` (the app's drafting options) with this answer's sampling and length."""
        return dataclasses.replace(
            base,
            max_new_tokens=self.max_tokens,
            sampling=SamplingParams(temperature=self.temperature),
            num_draft=0 if self.server_only else base.num_draft,
        )

    def connection(self) -> tuple[str, str, bool]:
        """What a change of needs a new connection (sampling and length apply per answer)."""
        return self.server, self.draft, self.server_only


def load_settings(store) -> ChatSettings:
    try:
        saved = json.loads(store.get_setting(SETTINGS_KEY) or "{}")
    except json.JSONDecodeError:
        saved = {}
    settings = ChatSettings()
    for field in dataclasses.fields(ChatSettings):
        if field.name in saved:
            try:
                settings = dataclasses.replace(settings, **{field.name: saved[field.name]})
            except (TypeError, ValueError):
                pass  # keep the default for a value that no longer validates
    return settings


def save_settings(store, settings: ChatSettings) -> None:
    store.set_setting(SETTINGS_KEY, json.dumps(dataclasses.asdict(settings)))


class SettingsPanel(QWidget):
    """The settings form; `applied` carries validated settings when the user presses Connect."""

    applied = Signal(object)  # ChatSettings

    def __init__(self, settings: ChatSettings, parent: QWidget | None = None):
        super().__init__(parent)
        self.server = QLineEdit(settings.server)
        self.server.setPlaceholderText("host:port")
        self.draft = QComboBox()
        self.draft.setEditable(True)  # a path typed or picked, besides the built-in names
        self.draft.addItems(sorted(BUILTINS))
        self.draft.setCurrentText(settings.draft)
        self.draft.setToolTip("A built-in draft model, or a .gguf file (Browse...)")
        browse = QPushButton("Browse...")
        browse.clicked.connect(self._browse)
        draft_row = QHBoxLayout()
        draft_row.setContentsMargins(0, 0, 0, 0)
        draft_row.addWidget(self.draft, 1)
        draft_row.addWidget(browse)
        self.temperature = QDoubleSpinBox()
        self.temperature.setRange(0.0, 2.0)
        self.temperature.setSingleStep(0.1)
        self.temperature.setValue(settings.temperature)
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, MAX_TOKENS_LIMIT)
        self.max_tokens.setValue(settings.max_tokens)
        self.server_only = QCheckBox("server only (no drafting)")
        self.server_only.setChecked(settings.server_only)
        self.connect_button = QPushButton("Connect")
        self.connect_button.clicked.connect(self.apply)
        self.error = QLabel()
        self.error.setWordWrap(True)
        self.error.setStyleSheet("color: #b00020")
        self.error.hide()

        form = QFormLayout(self)
        form.addRow("Server", self.server)
        form.addRow("Draft model", draft_row)
        form.addRow("Temperature", self.temperature)
        form.addRow("Max tokens", self.max_tokens)
        form.addRow(self.server_only)
        form.addRow(self.connect_button)
        form.addRow(self.error)

    def current(self) -> ChatSettings:
        """The form's settings; ValueError with a readable message when a field is wrong."""
        return ChatSettings(
            server=self.server.text().strip(),
            draft=self.draft.currentText().strip(),
            temperature=round(self.temperature.value(), 2),
            max_tokens=self.max_tokens.value(),
            server_only=self.server_only.isChecked(),
        )

    def apply(self) -> None:
        try:
            settings = self.current()
        except ValueError as exc:
            self.error.setText(str(exc))
            self.error.show()
            return
        self.error.hide()
        self.applied.emit(settings)

    def _browse(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Choose a draft model", "", "GGUF models (*.gguf)")
        if path:
            self.draft.setCurrentText(path)
