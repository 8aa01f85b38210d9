"""`specedge-chat`: open the desktop chat window.

specedge-chat                               remembered settings (first run: 127.0.0.1:50051, qwen2.5-coder-0.5b)
specedge-chat --server HOST:PORT --draft M  these instead (and remembered from now on)
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pathlib
import signal
import sys

import platformdirs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specedge-chat", description="SpecEdge desktop chat.")
    parser.add_argument("--server", default=None, help="HOST:PORT of specedge-server (default: the remembered one)")
    parser.add_argument("--draft", default=None, help="built-in name or .gguf file (default: the remembered one)")
    parser.add_argument(
        "--data-dir",
        type=pathlib.Path,
        default=None,
        help="where conversations are kept (default: the user's data directory)",
    )
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for the draft model")
    parser.add_argument("--log-level", default="warning", help="log level of messages on stderr")
    return parser.parse_args(argv)


def default_data_dir() -> pathlib.Path:
    """$SPECEDGE_CHAT_DATA if set, else the platform's per-user data directory."""
    if env := os.environ.get("SPECEDGE_CHAT_DATA"):
        return pathlib.Path(env).expanduser()
    return platformdirs.user_data_path("specedge")


def _plain_words_for_unexpected_errors(app) -> None:
    """A bug in a slot must not print a traceback at the user: one line in a dialog, the rest in the log."""
    from PySide6.QtWidgets import QMessageBox

    def hook(kind, value, tb):
        if issubclass(kind, KeyboardInterrupt):
            app.quit()
            return
        logging.getLogger("specedge.chat").error("unexpected error", exc_info=(kind, value, tb))
        QMessageBox.warning(app.activeWindow(), "SpecEdge Chat", f"Something went wrong: {kind.__name__}: {value}")

    sys.excepthook = hook


def _quit_on_ctrl_c(app, window) -> None:
    """Ctrl-C in the terminal closes the window as its close button would (answers kept, slots freed).

    Python runs signal handlers only between bytecodes, and Qt's event loop is
    C++, so a timer hands control back to Python a few times a second.
    """
    from PySide6.QtCore import QTimer

    signal.signal(signal.SIGINT, lambda *_: window.close())
    tick = QTimer(app, interval=250)
    tick.timeout.connect(lambda: None)
    tick.start()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from PySide6.QtWidgets import QApplication
    except ImportError as exc:
        print(f'specedge-chat: Qt is not available ({exc}): pip install "specedge[desktop]"', file=sys.stderr)
        return 1
    from specedge.edge_client.desktop.settings import load_settings
    from specedge.edge_client.desktop.store import ChatStore, StoreError
    from specedge.edge_client.desktop.window import DesktopConfig, MainWindow
    from specedge.edge_client.desktop.worker import WorkerConfig

    app = QApplication(sys.argv[:1])
    app.setApplicationName("SpecEdge Chat")
    _plain_words_for_unexpected_errors(app)
    data_dir = args.data_dir or default_data_dir()
    try:
        settings = None
        if args.server or args.draft:  # the command line overrides the remembered settings, field by field
            store = ChatStore(data_dir / "chat.sqlite3")
            remembered = load_settings(store)
            store.close()
            settings = dataclasses.replace(
                remembered, server=args.server or remembered.server, draft=args.draft or remembered.draft
            )
        window = MainWindow(DesktopConfig(data_dir, WorkerConfig(threads=args.threads), settings))
    except (StoreError, ValueError) as exc:
        print(f"specedge-chat: {exc}", file=sys.stderr)
        return 1
    window.show()
    _quit_on_ctrl_c(app, window)
    return app.exec()


if __name__ == "__main__":
    sys.exit(main())
