"""The remembered settings: where the server is, how to reach it safely, the draft model, sampling.

They live in the conversation file's settings table (one JSON value), so a
data directory carries everything the app remembers. The access token is
remembered there too: the file is readable by its owner only (store.py), and
it already holds the user's conversations. A desktop app is started from a
menu, where no $SPECEDGE_TOKEN is set, so the environment is no place for it;
and a keyring has no backend on many Linux desktops.

A stored value that no longer validates (hand-edited, or from an older
version) falls back to the defaults field by field rather than stopping the app.
"""

from __future__ import annotations

import dataclasses
import json

from specedge.edge_client.channel import ChannelSecurity
from specedge.edge_client.client import ConnectionConfig
from specedge.edge_client.policy import SpeculationPolicy, proactive_by_default
from specedge.edge_client.runtime import RuntimeConfig
from specedge.types import SamplingParams

SETTINGS_KEY = "chat_settings"
MAX_TOKENS_LIMIT = 32768
SAMPLING_FIELDS = ("temperature", "max_tokens")  # applied per answer: changing them needs no reconnect


@dataclasses.dataclass(frozen=True)
class ChatSettings:
    server: str = "127.0.0.1:50051"  # HOST:PORT of specedge-server; with a fleet broker, the fallback ("": none)
    draft: str = "qwen2.5-coder-0.5b"  # built-in name, .gguf file or HF directory (also the tokenizer)
    temperature: float = 0.0  # 0: greedy, token-identical to the server alone
    max_tokens: int = 1024  # per answer
    server_only: bool = False  # no drafting: the server generates alone (the baseline)
    # Fleet discovery: mqtt://HOST:PORT or mqtts://HOST:PORT; set, the least-loaded compatible server
    # announced there is used (as `specedge-edge --discover`), and `server` only when it has none.
    fleet_broker: str = ""
    use_tls: bool = False  # connect with TLS; the tls_* files below apply only then
    tls_ca: str = ""  # PEM file of the CA that signed the server's certificate ("": the system's CAs)
    tls_cert: str = ""  # PEM client certificate, for servers that require mutual TLS
    tls_key: str = ""  # its private key
    token: str = dataclasses.field(default="", repr=False)  # access token from `specedge-server make-token`

    def __post_init__(self):
        if self.server or not self.fleet_broker:
            host, _, port = self.server.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"server address must be HOST:PORT, got {self.server!r}")
        if not self.draft.strip():
            raise ValueError("choose a draft model: a built-in name or a .gguf file")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be between 0 and 2, got {self.temperature}")
        if not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise ValueError(f"max tokens must be between 1 and {MAX_TOKENS_LIMIT}, got {self.max_tokens}")
        if any(char.isspace() for char in self.token):
            raise ValueError("the access token has spaces or line breaks in it: paste line 1 of make-token's output")
        self.security()  # the channel's own checks (a client certificate needs its key)
        self.broker()  # the broker URL's own checks

    def security(self) -> ChannelSecurity:
        """How the edge's channel is secured (edge_client/channel.py), exactly as `specedge-edge --tls...` would."""
        if not self.use_tls:
            return ChannelSecurity(token=self.token or None)
        return ChannelSecurity(
            token=self.token or None,
            tls=True,
            tls_ca=self.tls_ca or None,
            tls_cert=self.tls_cert or None,
            tls_key=self.tls_key or None,
        )

    def broker(self):
        """The fleet broker (specedge.fleet.broker.BrokerConfig), or None without one."""
        if not self.fleet_broker:
            return None
        from specedge.fleet.broker import BrokerConfig, FleetError

        try:
            return BrokerConfig(self.fleet_broker)
        except FleetError as exc:
            raise ValueError(str(exc)) from None

    def runtime_config(
        self, draft: str, policy: SpeculationPolicy, connection: ConnectionConfig, threads: int | None = None
    ) -> RuntimeConfig:
        """The edge runtime these settings ask for: `draft` (the resolved draft model), the app's drafting
        `policy` and `connection` options with these settings' sampling, TLS and token."""
        discovery = None
        if (broker := self.broker()) is not None:
            from specedge.fleet.broker import require_aiomqtt
            from specedge.fleet.discovery import DiscoveryConfig

            require_aiomqtt()  # before any connection: FleetError naming the extra to install
            discovery = DiscoveryConfig(broker)  # as `specedge-edge --discover`: `server` is the fallback
        return RuntimeConfig(
            server=self.server or None,
            draft=draft,
            policy=self.policy(policy),
            connection=dataclasses.replace(connection, security=self.security()),
            server_only=self.server_only,
            threads=threads,
            discovery=discovery,
        )

    def policy(self, base: SpeculationPolicy) -> SpeculationPolicy:
        """`base` (the app's drafting options) with this answer's sampling and length; no proactive drafting
        for a server on this machine (it would slow the verify it waits for: README, 'One box')."""
        return dataclasses.replace(
            base,
            proactive=base.proactive and proactive_by_default(self.server or None, discovered=bool(self.fleet_broker)),
            max_new_tokens=self.max_tokens,
            sampling=SamplingParams(temperature=self.temperature),
            num_draft=0 if self.server_only else base.num_draft,
        )

    def connection(self) -> tuple:
        """What a change of needs a new connection (sampling and length apply per answer)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in SAMPLING_FIELDS)


def load_settings(store) -> ChatSettings:
    try:
        saved = json.loads(store.get_setting(SETTINGS_KEY) or "{}")
    except json.JSONDecodeError:
        saved = {}
    if not isinstance(saved, dict):
        saved = {}
    known = {field.name: saved[field.name] for field in dataclasses.fields(ChatSettings) if field.name in saved}
    try:
        return ChatSettings(**known)  # as a whole first: some fields only validate together (a certificate, its key)
    except (TypeError, ValueError):
        pass
    settings = ChatSettings()
    for name, value in known.items():
        try:
            settings = dataclasses.replace(settings, **{name: value})
        except (TypeError, ValueError):
            pass  # keep the default for a value that no longer validates
    return settings


def save_settings(store, settings: ChatSettings) -> None:
    store.set_setting(SETTINGS_KEY, json.dumps(dataclasses.asdict(settings)))
