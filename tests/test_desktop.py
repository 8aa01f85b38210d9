"""specedge-chat, driven as a person would: real widgets (offscreen), a real server, tiny models.

Each window gets its own data directory. Answers are compared with the
server generating alone (EdgeRuntime server-only), decoded the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hashlib
import os
import stat
import threading

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QImage
from PySide6.QtWidgets import QInputDialog, QMessageBox

from harness import ServerThread, free_port, make_pki
from specedge import registry
from specedge.edge_client.channel import ChannelSecurity
from specedge.edge_client.client import ConnectionConfig
from specedge.edge_client.desktop import stats as figures
from specedge.edge_client.desktop import worker as outcomes
from specedge.edge_client.desktop.collector import GuiThreadCollector
from specedge.edge_client.desktop.settings import ChatSettings, load_settings, save_settings
from specedge.edge_client.desktop.settings_panel import SettingsPanel
from specedge.edge_client.desktop.store import DONE, INTERRUPTED, STOPPED, STREAMING, ChatStore
from specedge.edge_client.desktop.window import DesktopConfig, MainWindow
from specedge.edge_client.desktop.worker import State, WorkerConfig
from specedge.edge_client.policy import SpeculationPolicy
from specedge.edge_client.runtime import EdgeRuntime, RuntimeConfig
from specedge.server.app import ServerConfig
from specedge.server.auth import make_token
from specedge.server.engine import EngineConfig
from specedge.server.transport import TransportConfig

MAX_TOKENS = 32
WAIT_MS = 60_000
# Quick reactions for tests: the idle check and the reconnect backoff in fractions of a second.
FAST = dict(watch_interval_s=0.3, retry_initial_s=0.3, retry_max_s=0.6)


pytestmark = pytest.mark.server_options(max_context=512, max_sessions=4)


def open_window(qtbot, data_dir, address, draft, *, max_tokens=MAX_TOKENS, settings=True, **worker) -> MainWindow:
    """settings: True, these address/draft/max_tokens; False, the remembered ones; or ChatSettings fields to add."""
    worker.setdefault("policy", SpeculationPolicy(slow_draft_fallback=False))  # tiny drafts are not slow, just tiny
    chosen = None
    if settings:
        more = settings if isinstance(settings, dict) else {}
        chosen = ChatSettings(server=address, draft=str(draft), max_tokens=max_tokens, **more)
    window = MainWindow(DesktopConfig(data_dir, WorkerConfig(**worker), chosen))
    qtbot.addWidget(window)
    window.show()
    return window


def wait_state(qtbot, window, state: State, timeout=WAIT_MS) -> None:
    qtbot.waitUntil(lambda: window.state is state, timeout=timeout)


def ask(qtbot, window, text: str) -> str:
    """Type `text`, press Enter, wait for the answer to end; returns the outcome."""
    qtbot.keyClicks(window.input, text)
    with qtbot.waitSignal(window.answer_ended, timeout=WAIT_MS) as ended:
        qtbot.keyClick(window.input, Qt.Key.Key_Return)
    return ended.args[1]


class Heartbeat:
    """Ticks of a 20 ms timer on the UI thread: a long gap between two means the window froze."""

    def __init__(self):
        import time

        from PySide6.QtCore import QTimer

        self.ticks = [time.monotonic()]
        self.timer = QTimer(interval=20)
        self.timer.timeout.connect(lambda: self.ticks.append(time.monotonic()))
        self.timer.start()

    def longest_gap_s(self) -> float:
        self.timer.stop()
        return max(b - a for a, b in zip(self.ticks, self.ticks[1:]))


def server_only_text(address, draft, messages, max_tokens, security=ChannelSecurity()) -> str:
    async def run():
        policy, connection = SpeculationPolicy(max_new_tokens=max_tokens), ConnectionConfig(security=security)
        runtime = EdgeRuntime(RuntimeConfig(address, str(draft), policy, connection, server_only=True))
        await runtime.start()
        try:
            result = await runtime.generate(runtime.chat_prompt(messages))
            eos = set(runtime.tokenizer.eos_token_ids)
            return runtime.tokenizer.decode([t for t in result.token_ids if t not in eos])  # as --server-only --json
        finally:
            await runtime.close()

    return asyncio.run(run())


def test_streamed_answer_equals_server_only(qtbot, tmp_path, server, tiny_draft_dir):
    window = open_window(qtbot, tmp_path, server.address, tiny_draft_dir)
    wait_state(qtbot, window, State.CONNECTED)
    assert window.connection.label.text().startswith("Connected: ")  # and the server's model name
    deltas = []
    window.worker.signals.delta.connect(lambda answer_id, text, live: deltas.append(text))

    qtbot.keyClicks(window.input, "def add(a, b):")
    qtbot.keyClick(window.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)  # a new line, not a send
    assert window.store.messages(window.current) == []
    outcome = ask(qtbot, window, "    return a + b")

    assert outcome == outcomes.DONE
    user, answer = window.store.messages(window.current)
    assert user.content == "def add(a, b):\n    return a + b"
    assert answer.status == DONE and answer.content
    assert len(deltas) > 1  # streamed in pieces, not delivered at the end
    expected = server_only_text(server.address, tiny_draft_dir, [{"role": "user", "content": user.content}], MAX_TOKENS)
    assert answer.content == expected
    assert answer.stats["draft_tokens"] > 0 and answer.stats["num_tokens"] > 0  # it did draft
    assert window.stats.answer.values["tokens/s"].text() == f"{answer.stats['tokens_per_s']:.1f}"
    assert window.input.toPlainText() == ""
    assert window.store.title(window.current) == "def add(a, b):"  # a new chat is named after its first line

    # Regenerate answers the same turn again: greedy, so the same text, and still one answer.
    with qtbot.waitSignal(window.answer_ended, timeout=WAIT_MS):
        qtbot.mouseClick(window.regenerate_button, Qt.MouseButton.LeftButton)
    messages = window.store.messages(window.current)
    assert [m.role for m in messages] == ["user", "assistant"] and messages[1].content == expected


def test_stop_cancels_and_frees_the_server_slot(qtbot, tmp_path, server, tiny_draft_dir):
    # An answer long enough to stop halfway. It drafts whatever the server advises: on a crowded CPU the
    # advice can turn drafting off, and the answer would then never reach the draft tokens waited for.
    slow = ConnectionConfig(simulated_rtt_ms=60, reconnect_timeout_s=2)
    options = dict(max_tokens=400, connection=slow, policy=SpeculationPolicy(follow_advice=False))
    window = open_window(qtbot, tmp_path, server.address, tiny_draft_dir, **options)
    wait_state(qtbot, window, State.CONNECTED)
    qtbot.keyClicks(window.input, "The quick brown fox")
    heartbeat = Heartbeat()
    qtbot.keyClick(window.input, Qt.Key.Key_Return)
    qtbot.waitUntil(
        lambda: window.answer is not None and bool(window.answer.text) and window.answer.live["draft_tokens"] > 40,
        timeout=WAIT_MS,
    )
    assert heartbeat.longest_gap_s() < 0.5  # the window kept redrawing while the edge drafted and waited
    assert server.server.engine.sessions  # the answer holds a slot while it runs
    assert window.stop_button.isEnabled() and not window.send_button.isEnabled()

    with qtbot.waitSignal(window.answer_ended, timeout=WAIT_MS) as ended:
        qtbot.mouseClick(window.stop_button, Qt.MouseButton.LeftButton)
    assert ended.args[1] == outcomes.STOPPED
    engine = server.server.engine
    qtbot.waitUntil(lambda: not engine.sessions and engine.slots.num_free == engine.slots.num_slots, timeout=10_000)
    answer = window.store.messages(window.current)[-1]
    assert answer.status == STOPPED and answer.content  # the partial answer is kept, marked
    assert answer.stats["num_tokens"] < 400
    assert "[stopped]" in window.transcript.toPlainText()
    assert window.send_button.isEnabled()


def test_offline_then_reconnect_and_partial_answers_kept(qtbot, tmp_path, tiny_target_dir, tiny_draft_dir):
    port = free_port()
    address = f"127.0.0.1:{port}"
    window = open_window(
        qtbot,
        tmp_path,
        address,
        tiny_draft_dir,
        max_tokens=400,
        connection=ConnectionConfig(reconnect_timeout_s=1.0, simulated_rtt_ms=60),
        **FAST,
    )
    wait_state(qtbot, window, State.OFFLINE)
    assert "cannot reach the server" in window.connection.label.text()
    assert window.connection.reconnect_button.isVisible() and not window.send_button.isEnabled()

    def serve():
        return ServerThread(ServerConfig(model=str(tiny_target_dir), port=port, max_context=512, engine=EngineConfig()))

    first = serve().__enter__()
    qtbot.mouseClick(window.connection.reconnect_button, Qt.MouseButton.LeftButton)  # now, not after the backoff
    wait_state(qtbot, window, State.CONNECTED)
    assert not window.connection.reconnect_button.isVisible()
    qtbot.keyClicks(window.input, "The quick brown fox")
    qtbot.keyClick(window.input, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: window.answer is not None and len(window.answer.text) > 0, timeout=WAIT_MS)
    with qtbot.waitSignal(window.answer_ended, timeout=WAIT_MS) as ended:
        first.__exit__(None, None, None)  # the server goes away mid-answer
    assert ended.args[1] == outcomes.INTERRUPTED
    answer = window.store.messages(window.current)[-1]
    assert answer.status == INTERRUPTED and answer.content  # kept, and marked
    assert "[interrupted]" in window.transcript.toPlainText()
    assert window.error.isVisible() and "Traceback" not in window.error.text()
    wait_state(qtbot, window, State.OFFLINE)

    with serve():  # back on the same port: the backoff finds it by itself
        wait_state(qtbot, window, State.CONNECTED)
        # The chat goes on with the partial answer in its history, on the new server.
        assert ask(qtbot, window, "print(i * i)") == outcomes.DONE
        window.close()  # before the server goes, so that the idle check does not race the shutdown


def test_conversations_persist_across_restart(qtbot, tmp_path, server, tiny_draft_dir, monkeypatch):
    # The Rename and Delete dialogs answer as a user would.
    monkeypatch.setattr(QInputDialog, "getText", lambda *args, **kwargs: ("adding", True))
    monkeypatch.setattr(QMessageBox, "question", lambda *args, **kwargs: QMessageBox.StandardButton.Yes)
    window = open_window(qtbot, tmp_path, server.address, tiny_draft_dir)
    wait_state(qtbot, window, State.CONNECTED)
    window.settings_panel.max_tokens.setValue(12)  # remembered from the next answer on
    assert ask(qtbot, window, "def add(a, b):") == outcomes.DONE
    first = window.current
    qtbot.mouseClick(window.conversations.rename_button, Qt.MouseButton.LeftButton)
    assert window.conversations.list.currentItem().text() == "adding"
    qtbot.mouseClick(window.conversations.new_button, Qt.MouseButton.LeftButton)
    assert window.current != first
    assert ask(qtbot, window, "for i in range(10):") == outcomes.DONE
    third = window.store.new_conversation("to delete")
    saved = {cid: window.store.messages(cid) for cid in (first, window.current)}
    import threading

    late = threading.Thread(target=window.worker.signals.state.emit, args=("offline", "late news"))
    late.start()
    late.join()  # queued for the window, not yet delivered
    window.close()
    qtbot.wait(50)  # delivered now, to a closed window: ignored, not an exception

    # A run that died mid-answer leaves a "streaming" row: the next start marks it interrupted.
    store = ChatStore(tmp_path / "chat.sqlite3")
    store.add_message(first, "user", "crash here")
    crashed = store.add_message(first, "assistant", "half an ans", STREAMING)
    store.close()

    again = open_window(qtbot, tmp_path, server.address, tiny_draft_dir, settings=False)  # remembered settings
    assert again.settings.server == server.address and again.settings.max_tokens == 12
    assert again.settings_panel.max_tokens.value() == 12
    titles = {info.id: info.title for info in again.store.conversations()}
    assert titles[first] == "adding" and titles[third] == "to delete"
    second = next(cid for cid in saved if cid != first)
    assert again.store.messages(second) == saved[second]
    assert again.store.messages(first)[: len(saved[first])] == saved[first]
    assert again.store.messages(first)[-1].id == crashed and again.store.messages(first)[-1].status == INTERRUPTED
    assert saved[first][1].stats["num_tokens"] <= 12
    again.select(first)
    assert "half an ans" in again.transcript.toPlainText() and "[interrupted]" in again.transcript.toPlainText()
    assert again.stats.overall.values["tokens"].text() == str(sum(m[1].stats["num_tokens"] for m in saved.values()))
    again.select(third)
    qtbot.mouseClick(again.conversations.delete_button, Qt.MouseButton.LeftButton)
    assert third not in again.conversations.ids() and len(again.conversations.ids()) == 2
    assert again.store.messages(third) == [] and again.current in again.conversations.ids()


def test_screenshot_of_a_finished_answer(qtbot, tmp_path, server, tiny_draft_dir):
    window = open_window(qtbot, tmp_path, server.address, tiny_draft_dir)
    wait_state(qtbot, window, State.CONNECTED)
    assert ask(qtbot, window, "Speculative decoding drafts tokens on the edge") == outcomes.DONE
    path = tmp_path / "desktop-chat.png"
    assert window.grab().save(str(path))
    if keep := os.environ.get("SPECEDGE_SCREENSHOT_DIR"):  # to look at it, or to refresh the one in docs/
        window.grab().save(os.path.join(keep, "desktop-chat-tiny.png"))
    image = QImage(str(path))
    assert image.width() == window.width() and image.height() == window.height()
    colors = {image.pixel(x, y) for x in range(0, image.width(), 7) for y in range(0, image.height(), 7)}
    assert len(colors) > 20  # text, widgets and the chart: not a blank or single-colour frame


def test_incompatible_draft_is_named(qtbot, tmp_path, server, tiny_foreign_dir):
    window = open_window(qtbot, tmp_path, server.address, tiny_foreign_dir)
    wait_state(qtbot, window, State.INCOMPATIBLE)
    assert "vocab" in window.connection.label.text()
    assert not window.send_button.isEnabled() and window.connection.reconnect_button.isVisible()


@pytest.fixture(scope="module")
def secured(tmp_path_factory, tiny_target_dir):
    """The recommended deployment: TLS, edge certificates required (mutual TLS), and an access token."""
    folder = tmp_path_factory.mktemp("secured")
    pki = make_pki(folder)
    token, line = make_token("desk")
    (folder / "tokens").write_text(line + "\n")
    transport = TransportConfig(tls_cert=pki["server_cert"], tls_key=pki["server_key"], tls_client_ca=pki["client_ca"])
    config = ServerConfig(
        model=str(tiny_target_dir),
        port=0,
        max_context=512,
        transport=transport,
        auth_tokens=str(folder / "tokens"),
        engine=EngineConfig(max_sessions=4),
    )
    with ServerThread(config) as running:
        yield running, pki, token


def refused_words(window) -> str:
    """The connection bar's sentence, checked to be plain words: no traceback, no gRPC or TLS library codes."""
    text = window.connection.label.text()
    assert text.startswith("Refused: "), text
    for jargon in ("Traceback", "UNAUTHENTICATED", "UNAVAILABLE", "SSL_ERROR", "--token", "--tls"):
        assert jargon not in text, text
    assert window.connection.reconnect_button.isVisible() and not window.send_button.isEnabled()
    return text[len("Refused: ") :]


def test_token_and_mutual_tls_from_the_settings(qtbot, tmp_path, secured, tiny_draft_dir):
    server, pki, token = secured
    tls = dict(use_tls=True, tls_ca=pki["server_ca"], tls_cert=pki["client_cert"], tls_key=pki["client_key"])
    window = open_window(qtbot, tmp_path, server.address, tiny_draft_dir, settings=dict(tls, token="se_" + "x" * 43))
    wait_state(qtbot, window, State.REFUSED)
    assert refused_words(window).startswith("the server does not accept this access token")

    # The user pastes the right token (with the line break a copy brings) and presses Connect.
    window.settings_panel.token.setText(token + "\n")
    qtbot.mouseClick(window.settings_panel.connect_button, Qt.MouseButton.LeftButton)
    wait_state(qtbot, window, State.CONNECTED)
    assert f" at {server.address}" in window.connection.label.text()
    assert ask(qtbot, window, "print(i * i)") == outcomes.DONE
    answer = window.store.messages(window.current)[-1]
    right = ChatSettings(server=server.address, draft=str(tiny_draft_dir), token=token, **tls)
    expected = server_only_text(
        server.address, tiny_draft_dir, [{"role": "user", "content": "print(i * i)"}], MAX_TOKENS, right.security()
    )
    assert answer.content == expected and answer.stats["draft_tokens"] > 0
    window.close()

    again = open_window(qtbot, tmp_path, server.address, tiny_draft_dir, settings=False)  # a restart
    assert again.settings == dataclasses.replace(right, max_tokens=MAX_TOKENS)
    assert again.settings_panel.tls.isChecked() and again.settings_panel.token.text() == token
    wait_state(qtbot, again, State.CONNECTED)


def test_refused_tls_is_told_in_plain_words(qtbot, tmp_path, secured, tiny_draft_dir):
    server, pki, token = secured
    window = open_window(qtbot, tmp_path, server.address, tiny_draft_dir, settings=dict(token=token))
    panel = window.settings_panel

    def connect_and_read() -> str:
        before = window.connection.label.text()
        qtbot.mouseClick(panel.connect_button, Qt.MouseButton.LeftButton)
        qtbot.waitUntil(
            lambda: window.state is State.REFUSED and window.connection.label.text() != before, timeout=WAIT_MS
        )
        return refused_words(window)

    wait_state(qtbot, window, State.REFUSED)  # plaintext to a TLS server
    assert "requires TLS: turn Use TLS on" in refused_words(window)
    panel.tls.setChecked(True)  # with the system's CAs, which never signed this test certificate
    assert "not signed by a CA this system trusts" in connect_and_read()
    panel.tls_ca.setText(pki["rogue_ca"])
    assert "not signed by the CA file you chose" in connect_and_read()
    panel.tls_ca.setText(pki["server_ca"])
    assert "requires a client certificate" in connect_and_read()
    panel.tls_cert.setText(pki["rogue_cert"])
    qtbot.mouseClick(panel.connect_button, Qt.MouseButton.LeftButton)
    assert panel.error.isVisible() and "needs its key" in panel.error.text()  # the form says so; nothing is tried
    panel.tls_key.setText(pki["rogue_key"])
    assert "does not accept your client certificate" in connect_and_read()
    panel.tls_cert.setText(pki["client_cert"])
    panel.tls_key.setText(pki["client_key"])
    qtbot.mouseClick(panel.connect_button, Qt.MouseButton.LeftButton)
    wait_state(qtbot, window, State.CONNECTED)
    assert not panel.error.isVisible()


def test_refusal_words_for_what_the_tests_cannot_stage_cheaply():
    """grpcio's own details for failures the tests above do not start a server for (seen once, then kept here)."""
    from specedge.edge_client.client import ConnectionLost, EdgeError
    from specedge.edge_client.desktop.connection_words import refusal

    def lost(last_error: str) -> ConnectionLost:
        return ConnectionLost(
            f"cannot reach the server at h:1 (failed to connect to all addresses; last error: "
            f"UNKNOWN: ipv4:127.0.0.2:1: {last_error}); is specedge-server running?"
        )

    tls = ChatSettings(use_tls=True)
    expired = (
        "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:"
        "OPENSSL_internal:CERTIFICATE_VERIFY_FAILED: certificate has expired: OK"
    )
    assert refusal(lost(expired), tls) == "the server's certificate has expired: tell its operator"
    hostname = "Custom verification check failed with error: UNAUTHENTICATED: Hostname Verification Check failed."
    assert "another name" in refusal(lost(hostname), tls)
    plaintext_server = (
        "Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:100000f7:SSL routines:"
        "OPENSSL_internal:WRONG_VERSION_NUMBER: Invalid certificate verification context"
    )
    assert refusal(lost(plaintext_server), tls) == "the server does not speak TLS: turn Use TLS off"
    assert refusal(lost("Failed to connect to remote host: Connection refused"), tls) is None  # just not there
    no_token = EdgeError(
        "server refused: UNAUTHENTICATED: this server requires a token: pass --token ...", status="UNAUTHENTICATED"
    )
    assert refusal(no_token, ChatSettings()).startswith("the server needs an access token")
    assert refusal(EdgeError("draft vocab 320 != target vocab 512", status="FAILED_PRECONDITION"), tls) is None


def test_fleet_broker_chooses_the_server(qtbot, tmp_path, tiny_target_dir, tiny_draft_dir):
    """As `specedge-edge --discover`: the server announced on the broker, not the (dead) fallback address."""
    from mqtt_broker import Broker
    from specedge.fleet.announcer import AnnouncerConfig
    from specedge.fleet.broker import BrokerConfig

    with Broker(tmp_path) as broker:
        fleet = AnnouncerConfig(BrokerConfig(broker.url), server_id="desk-a", period_s=1.0, check_s=0.05)
        config = ServerConfig(model=str(tiny_target_dir), port=0, max_context=512, fleet=fleet)
        with ServerThread(config) as server:
            fallback = f"127.0.0.1:{free_port()}"  # nothing listens there
            window = open_window(qtbot, tmp_path, fallback, tiny_draft_dir, settings=dict(fleet_broker=broker.url))
            wait_state(qtbot, window, State.CONNECTED)
            assert window.connection.label.text().endswith(f" at {server.address} (fleet server desk-a)")
            assert ask(qtbot, window, "print(i * i)") == outcomes.DONE
            window.close()  # before the server and the broker go


def test_first_run_assembly_shows_progress(qtbot, tmp_path, server, tiny_draft_dir):
    """The built-in assembly path (registry.assemble) with a small fake chunk set, slowed down to be seen."""
    chunks = [bytes([n]) * 4096 for n in range(6)]
    parts = tuple(registry.Part(f"fake-part{n}", "1.0", f"fake_part{n}", f"data/part{n:02d}.bin") for n in range(6))
    spec = registry.BuiltinModel(
        "fake-draft", "fake-draft.gguf", sum(map(len, chunks)), hashlib.sha256(b"".join(chunks)).hexdigest(), parts
    )
    files = {}
    for part, data in zip(parts, chunks):
        files[part] = tmp_path / f"{part.module}.bin"
        files[part].write_bytes(data)

    def open_part(part):
        import time

        time.sleep(0.25)  # a slow disk: the window must keep redrawing meanwhile
        return open(files[part], "rb")

    def resolver(name, on_progress):
        path = registry.assemble(spec, tmp_path / "cache", open_part, on_progress)
        assert path.read_bytes() == b"".join(chunks)
        return registry.ResolvedModel(name, "hf", tiny_draft_dir)  # the assembled bytes are no model

    window = open_window(qtbot, tmp_path, server.address, "fake-draft", resolver=resolver)
    heartbeat = Heartbeat()
    qtbot.waitUntil(lambda: 0 < window.progress.value() < 1000, timeout=WAIT_MS)
    assert window.progress.isVisible() and "fake-draft" in window.progress.text()
    assert window.connection.state is State.PREPARING
    wait_state(qtbot, window, State.CONNECTED)
    assert heartbeat.longest_gap_s() < 0.5  # the window never froze while the parts were read
    assert not window.progress.isVisible()
    assert (tmp_path / "cache" / "fake-draft.gguf").exists()


def test_rate_series_and_overall_weighting():
    assert figures.rate_series([(0.2, 3), (0.9, 5)], 1.0, num_points=2) == [0.0, 16.0]
    assert figures.rate_series([], 1.0) == []
    both = figures.overall(
        [
            {"num_tokens": 90, "elapsed_s": 1.0, "draft_tokens": 100, "accepted_tokens": 80},
            {"num_tokens": 10, "elapsed_s": 9.0, "draft_tokens": 0, "accepted_tokens": 0, "fallback": "slow"},
        ]
    )
    assert both["tokens_per_s"] == 10.0 and both["acceptance_rate"] == 0.8 and both["fallbacks"] == 1


def test_settings_are_validated():
    with pytest.raises(ValueError, match="HOST:PORT"):
        ChatSettings(server="localhost")
    with pytest.raises(ValueError, match="temperature"):
        ChatSettings(temperature=-1)
    with pytest.raises(ValueError, match="HOST:PORT"):
        ChatSettings(server="")  # no server and no fleet broker: nowhere to go
    assert ChatSettings(server="", fleet_broker="mqtt://broker.lan").broker().port == 1883
    with pytest.raises(ValueError, match="mqtt://HOST:PORT"):
        ChatSettings(fleet_broker="http://broker.lan")
    with pytest.raises(ValueError, match="needs its key"):
        ChatSettings(use_tls=True, tls_cert="edge.crt")
    with pytest.raises(ValueError, match="spaces or line breaks"):
        ChatSettings(token="se_abc def")
    assert ChatSettings(tls_ca="ca.pem", tls_cert="edge.crt").security() == ChannelSecurity()  # TLS off: files unused
    assert ChatSettings(use_tls=True, token="se_x").security() == ChannelSecurity(token="se_x", tls=True)
    assert "se_secret" not in repr(ChatSettings(token="se_secret"))


def test_settings_round_trip_and_owner_only_file(qtbot, tmp_path):
    """Every setting survives a restart; the file that keeps the token is readable by its owner only."""
    settings = ChatSettings(
        server="",
        fleet_broker="mqtts://broker.lan:8883",
        draft="smollm2-135m",
        temperature=0.7,
        max_tokens=99,
        server_only=True,
        use_tls=True,
        tls_ca="/etc/ca.pem",
        tls_cert="/home/a/edge.crt",
        tls_key="/home/a/edge.key",
        token="se_abcdef",
    )
    panel = SettingsPanel(settings)
    qtbot.addWidget(panel)
    assert panel.current() == settings  # every field shows in the form and reads back the same
    with qtbot.waitSignal(panel.applied) as applied:
        qtbot.mouseClick(panel.connect_button, Qt.MouseButton.LeftButton)
    assert applied.args == [settings]
    store = ChatStore(tmp_path / "data" / "chat.sqlite3")
    save_settings(store, applied.args[0])
    store.close()
    reopened = ChatStore(tmp_path / "data" / "chat.sqlite3")
    assert load_settings(reopened) == settings
    reopened.set_setting("chat_settings", '{"use_tls": true, "tls_cert": "edge.crt", "token": "se_ok"}')
    kept = load_settings(reopened)  # a certificate without its key: that field falls back, the rest is kept
    assert kept.use_tls and kept.token == "se_ok" and kept.tls_cert == ""
    for name in ("chat.sqlite3", "chat.sqlite3-wal"):
        assert stat.S_IMODE(os.stat(tmp_path / "data" / name).st_mode) == 0o600, name
    assert stat.S_IMODE(os.stat(tmp_path / "data").st_mode) == 0o700
    reopened.close()


REAL_PROMPT = "Write a short Python function that checks whether a number is prime."
REAL_MAX_TOKENS = int(os.environ.get("SPECEDGE_SCREENSHOT_TOKENS", 32))  # more for the docs picture


@pytest.mark.real_model
def test_real_pair_answer_and_screenshot(qtbot, tmp_path):
    """Qwen2.5-Coder 0.5B drafting in llama.cpp in the window, 1.5B verifying on a real server process."""
    from harness import start_server_process

    process, address = start_server_process("--model", "qwen2.5-coder-1.5b", "--max-sessions", "2")
    try:
        window = open_window(
            qtbot,
            tmp_path,
            address,
            "qwen2.5-coder-0.5b",
            max_tokens=REAL_MAX_TOKENS,
            policy=SpeculationPolicy(),
            connection=ConnectionConfig(),
        )
        wait_state(qtbot, window, State.CONNECTED, timeout=300_000)
        assert "qwen" in window.connection.label.text().lower()
        with qtbot.waitSignal(window.answer_ended, timeout=600_000) as ended:
            qtbot.keyClicks(window.input, REAL_PROMPT)
            qtbot.keyClick(window.input, Qt.Key.Key_Return)
        assert ended.args[1] == outcomes.DONE
        answer = window.store.messages(window.current)[-1]
        assert answer.stats["draft_tokens"] > 0 and answer.stats["acceptance_rate"] > 0.3
        if keep := os.environ.get("SPECEDGE_SCREENSHOT_DIR"):  # docs/desktop-chat.png comes from here
            window.grab().save(os.path.join(keep, "desktop-chat.png"))
        window.close()
        expected = server_only_text(
            address, "qwen2.5-coder-0.5b", [{"role": "user", "content": REAL_PROMPT}], REAL_MAX_TOKENS
        )
        assert answer.content == expected
    finally:
        process.send_signal(2)
        process.wait(timeout=30)


SIGNAL_STORM = """
import sys, threading
from PySide6.QtCore import QCoreApplication, QObject, Signal
app = QCoreApplication([])
class Source(QObject):
    changed = Signal(int, str, object)
class Sink:
    count = 0
    def take(self, *args):
        self.count += 1
source, sink = Source(), Sink()
source.changed.connect(sink.take)
before = sys.getrefcount(None), sys.getrefcount(True)
emit = lambda: [source.changed.emit(1, "piece", {"fallback": None}) for _ in range(20000)]
emit()  # on this thread: delivered at once
worker = threading.Thread(target=emit)  # from another thread, as the edge worker does: queued
worker.start()
while sink.count < 40000:
    app.processEvents()
worker.join()
after = sys.getrefcount(None), sys.getrefcount(True)
print(after[0] - before[0], after[1] - before[1])
"""


def test_qt_binding_keeps_reference_counts():
    """Some PySide6 releases (6.12.0) drop a reference on every signal delivered: a long chat then crashes."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SIGNAL_STORM], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (
        f"this PySide6 corrupts reference counts when signals are delivered: {done.stderr[-300:]}"
    )
    none_drift, true_drift = map(int, done.stdout.split())
    assert abs(none_drift) < 100 and abs(true_drift) < 100  # 40000 deliveries: any leak would show in thousands


class _Cycle:
    """Cyclic garbage that records the thread it is finalized on."""

    finalized_on: list[str] = []

    def __init__(self):
        self.me = self

    def __del__(self):
        _Cycle.finalized_on.append(threading.current_thread().name)


def test_garbage_is_collected_on_the_gui_thread_while_a_window_is_open(qtbot):
    """CI crashed collecting garbage in the edge worker's thread: while a window is open, only the GUI thread may."""
    from PySide6.QtCore import QObject

    assert gc.isenabled()
    _Cycle.finalized_on.clear()
    owner, other = QObject(), QObject()
    first, second = GuiThreadCollector(owner), GuiThreadCollector(other)
    try:
        assert not gc.isenabled()
        _Cycle()
        # Far more live allocations than the collector's threshold: automatic collection would run in this thread.
        kept: list = []
        worker = threading.Thread(target=lambda: kept.extend([] for _ in range(50 * gc.get_threshold()[0])))
        worker.start()
        worker.join()
        assert _Cycle.finalized_on == []
        qtbot.waitUntil(lambda: _Cycle.finalized_on != [], timeout=5_000)  # the timer collects: gen 0 is past due
        assert _Cycle.finalized_on == [threading.main_thread().name]
        first.close()
        first.close()  # twice is once
        assert not gc.isenabled()  # the other is still open
    finally:
        first.close()
        second.close()
    assert gc.isenabled()


def test_command_line_help():
    import subprocess
    import sys

    done = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "specedge-chat"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "--server" in done.stdout and "--data-dir" in done.stdout
