"""The settings form: connection (server, fleet broker, TLS, token), draft model, sampling.

Connect validates the form into ChatSettings (settings.py) and hands them on;
a wrong field is named under the button, in the settings' own words.
"""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QWidget,
)

from specedge.edge_client.desktop.settings import MAX_TOKENS_LIMIT, ChatSettings
from specedge.registry import BUILTINS

PEM_FILES = "PEM files (*.pem *.crt *.cer *.key);;All files (*)"
GGUF_FILES = "GGUF models (*.gguf)"


def _with_browse(field: QWidget, pick) -> QHBoxLayout:
    """`field` with a Browse... button beside it that calls `pick`."""
    browse = QPushButton("Browse...")
    browse.clicked.connect(pick)
    row = QHBoxLayout()
    row.setContentsMargins(0, 0, 0, 0)
    row.addWidget(field, 1)
    row.addWidget(browse)
    return row


class SettingsPanel(QWidget):
    """The settings form; `applied` carries validated settings when the user presses Connect."""

    applied = Signal(object)  # ChatSettings

    def __init__(self, settings: ChatSettings, parent: QWidget | None = None):
        super().__init__(parent)
        self.server = QLineEdit(settings.server)
        self.server.setPlaceholderText("host:port")
        self.fleet_broker = QLineEdit(settings.fleet_broker)
        self.fleet_broker.setPlaceholderText("optional: mqtt://host:1883")
        self.fleet_broker.setToolTip("Choose the server through this fleet broker; the server above is the fallback")
        self.token = QLineEdit(settings.token)
        self.token.setEchoMode(QLineEdit.EchoMode.Password)
        self.token.setPlaceholderText("none")
        self.token.setToolTip("From the server's operator (specedge-server make-token); kept in the app's data file")
        self.tls = QGroupBox("Use TLS")
        self.tls.setCheckable(True)
        self.tls.setChecked(settings.use_tls)
        self.tls_ca, self.tls_cert, self.tls_key = (
            QLineEdit(settings.tls_ca),
            QLineEdit(settings.tls_cert),
            QLineEdit(settings.tls_key),
        )
        self.tls_ca.setPlaceholderText("the system's CAs")
        self.tls_cert.setPlaceholderText("none (only for mutual TLS)")
        self.tls_key.setPlaceholderText("none")
        tls_form = QFormLayout(self.tls)
        for label, field, title in [
            ("CA file", self.tls_ca, "The CA that signed the server's certificate"),
            ("Client cert", self.tls_cert, "Your client certificate"),
            ("Client key", self.tls_key, "Your client certificate's key"),
        ]:
            tls_form.addRow(label, _with_browse(field, lambda _=False, f=field, t=title: self._pick(f, t, PEM_FILES)))
        self.draft = QComboBox()
        self.draft.setEditable(True)  # a path typed or picked, besides the built-in names
        self.draft.addItems(sorted(BUILTINS))
        self.draft.setCurrentText(settings.draft)
        self.draft.setToolTip("A built-in draft model, or a .gguf file (Browse...)")
        draft_row = _with_browse(self.draft, lambda: self._pick(self.draft, "Choose a draft model", GGUF_FILES))
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
        form.addRow("Fleet broker", self.fleet_broker)
        form.addRow("Access token", self.token)
        form.addRow(self.tls)
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
            fleet_broker=self.fleet_broker.text().strip(),
            use_tls=self.tls.isChecked(),
            tls_ca=self.tls_ca.text().strip(),
            tls_cert=self.tls_cert.text().strip(),
            tls_key=self.tls_key.text().strip(),
            token=self.token.text().strip(),
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

    def _pick(self, field: QLineEdit | QComboBox, title: str, kinds: str) -> None:
        path, _ = QFileDialog.getOpenFileName(self, title, "", kinds)
        if path:
            (field.setCurrentText if isinstance(field, QComboBox) else field.setText)(path)
