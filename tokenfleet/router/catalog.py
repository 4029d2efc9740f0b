"""Which model serves a request: pinned versions (`name-2026-10-01`), aliases pointing at the current version,
deprecation dates, pools of replicas per model and region, and rules-based product routing (by prompt length,
attachments or mode) for requests that name a routing alias such as `auto`."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenfleet.api.errors import APIError, not_found

REPLICA_KINDS = ("tokenfleet", "openai")  # ours, or any OpenAI-compatible server (vLLM, SGLang, ...)
REPLICA_ROLES = ("both", "prefill", "decode")


@dataclass
class PoolSpec:
    """Replicas of one model in one region (or zone, or rack): a latency from the gateway, and the replicas."""

    name: str = "default"
    replicas: list[str] = field(default_factory=list)  # base URLs; more join through the Redis registry
    kind: str = "tokenfleet"
    latency_ms: float = 0.0
    role: str = "both"  # the configured replicas' role: both | prefill | decode (disaggregated prefill/decode)

    def __post_init__(self) -> None:
        if self.kind not in REPLICA_KINDS:
            raise ValueError(f"pool {self.name}: kind must be one of {', '.join(REPLICA_KINDS)}, got {self.kind!r}")
        if self.role not in REPLICA_ROLES:
            raise ValueError(f"pool {self.name}: role must be one of {', '.join(REPLICA_ROLES)}, got {self.role!r}")
        if self.role != "both" and self.kind != "tokenfleet":
            raise ValueError(f"pool {self.name}: only tokenfleet replicas can be prefill or decode replicas")
        if self.latency_ms < 0:
            raise ValueError(f"pool {self.name}: latency_ms must be >= 0")
        for url in self.replicas:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"pool {self.name}: replica {url!r} is not an http(s) URL")


@dataclass
class ModelSpec:
    name: str  # a pinned version, e.g. demo-2026-10-01
    path: str  # checkpoint folder: the gateway reads its tokenizer and context window
    aliases: list[str] = field(default_factory=list)  # names that mean this version (e.g. "demo")
    deprecated_on: dt.date | None = None  # from this day the version is refused (until then: a warning header)
    pools: list[PoolSpec] = field(default_factory=lambda: [PoolSpec()])
    fallback: str | None = None  # another model to use when every pool of this one is unhealthy
    max_model_len: int | None = None

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], where: str) -> ModelSpec:
        raw = dict(raw)
        try:
            pools = [PoolSpec(**p) for p in raw.pop("pools", None) or [{}]]
            deprecated = raw.pop("deprecated_on", None)
            if isinstance(deprecated, str):
                deprecated = dt.date.fromisoformat(deprecated)
            return cls(**raw, pools=pools, deprecated_on=deprecated)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None


@dataclass
class RoutingRule:
    """`when` all of its conditions hold, a request to a routing alias goes to `model`. Conditions:
    min_prompt_tokens / max_prompt_tokens, attachments (true: the messages carry non-text parts), mode (the
    request's `mode` field or x-tokenfleet-mode header)."""

    model: str
    name: str = ""
    when: dict[str, Any] = field(default_factory=dict)

    CONDITIONS = ("min_prompt_tokens", "max_prompt_tokens", "attachments", "mode")

    def __post_init__(self) -> None:
        unknown = sorted(set(self.when) - set(self.CONDITIONS))
        if unknown:
            raise ValueError(
                f"rule {self.name or self.model}: unknown condition(s) {', '.join(unknown)}; "
                f"known: {', '.join(self.CONDITIONS)}"
            )

    def matches(self, facts: RequestFacts) -> bool:
        w = self.when
        return (
            facts.prompt_tokens >= w.get("min_prompt_tokens", 0)
            and facts.prompt_tokens <= w.get("max_prompt_tokens", float("inf"))
            and ("attachments" not in w or facts.attachments == bool(w["attachments"]))
            and ("mode" not in w or facts.mode == w["mode"])
        )


@dataclass(frozen=True)
class RequestFacts:
    prompt_tokens: int
    attachments: bool = False
    mode: str | None = None


@dataclass(frozen=True)
class Resolution:
    model: ModelSpec
    requested: str
    rule: str | None = None  # the product-routing rule that chose it
    deprecation: dt.date | None = None  # set while a deprecated version is still served


class ModelCatalog:
    def __init__(
        self,
        models: list[ModelSpec],
        router_aliases: dict[str, list[RoutingRule]] | None = None,
        today: Callable[[], dt.date] = dt.date.today,
    ) -> None:
        self.models = {m.name: m for m in models}
        self.router_aliases = router_aliases or {}
        self.today = today
        self.aliases = self._aliases(models)
        self._check()

    def _aliases(self, models: list[ModelSpec]) -> dict[str, str]:
        aliases: dict[str, str] = {}
        for m in models:
            for alias in m.aliases:
                if alias in aliases or alias in self.models:
                    raise ValueError(f"model alias {alias!r} is used twice")
                aliases[alias] = m.name
        return aliases

    def _check(self) -> None:
        if not self.models:
            raise ValueError("the fleet serves no model: give models (or model_name and model_path)")
        for m in self.models.values():
            if m.fallback is not None and m.fallback not in self.models:
                raise ValueError(f"model {m.name}: fallback {m.fallback!r} is not a configured model")
        for alias, rules in self.router_aliases.items():
            if alias in self.models or alias in self.aliases:
                raise ValueError(f"routing alias {alias!r} is also a model name")
            for rule in rules:
                if self.lookup(rule.model) is None:
                    raise ValueError(f"routing rule {rule.name or rule.model}: unknown model {rule.model!r}")

    def lookup(self, name: str) -> ModelSpec | None:
        return self.models.get(self.aliases.get(name, name))

    def resolve(self, requested: str, facts: RequestFacts) -> Resolution:
        rule = None
        name = requested
        if requested in self.router_aliases:
            rule = next((r for r in self.router_aliases[requested] if r.matches(facts)), None)
            if rule is None:
                raise APIError(
                    400, f"no routing rule of {requested!r} matches this request", param="model", code="no_route"
                )
            name = rule.model
        model = self.lookup(name)
        if model is None:
            raise not_found(f"The model `{requested}` does not exist", param="model", code="model_not_found")
        deprecated = model.deprecated_on
        if deprecated is not None and self.today() >= deprecated and requested not in self.aliases:
            raise not_found(
                f"The model `{model.name}` was deprecated on {deprecated.isoformat()}; use "
                f"{', '.join(self.current_names()) or 'another model'}",
                param="model",
                code="model_deprecated",
            )
        return Resolution(model, requested, rule.name or rule.model if rule else None, deprecated)

    def current_names(self) -> list[str]:
        return sorted(self.aliases)

    def listing(self) -> list[dict[str, Any]]:
        """What /v1/models shows: every version, every alias, every routing alias."""
        entries: list[dict[str, Any]] = [
            {"id": m.name, "deprecated_on": m.deprecated_on.isoformat() if m.deprecated_on else None}
            for m in self.models.values()
        ]
        entries += [{"id": alias, "alias_of": target} for alias, target in self.aliases.items()]
        entries += [{"id": alias, "routes_by_rules": True} for alias in self.router_aliases]
        return [{"object": "model", "created": 0, "owned_by": "tokenfleet", **e} for e in entries]
