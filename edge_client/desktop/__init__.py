"""`specedge-chat`: the desktop chat app (Qt 6 via PySide6).

store.py        conversations and settings in SQLite, each message written as it streams
settings.py     the remembered connection and model settings, and their form
worker.py       the edge runtime on its own thread (asyncio), talking to the window by Qt signals
stats.py        per-answer and overall speculative figures (pure Python)
transcript.py   the conversation rendered as Markdown, the streaming answer redrawn in place
widgets.py      the input box, the conversation list, the stats panel with its tokens/s sparkline
window.py       the main window: wires the pieces together
app.py          the command line entry point
"""
