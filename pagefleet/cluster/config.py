"""The one config schema: `pagefleet serve CONFIG`, `build_app(args)` under `serve deploy`,
and the Helm chart's values (helm/generate_schema.py) all hold exactly this.

Frozen pydantic models; unknown keys are errors that name the key. Paths in a
config file may be relative to that file (`load_config` resolves them).

Where the settings are written. Each layer's own config is a frozen dataclass
that declares every field once, default, range and description together
(`pagefleet.settings.setting`), and checks itself on construction:
`EngineConfig` (pagefleet/engine/config.py) for `engine:`, `AutoscalingPolicyConfig`
(pagefleet/cluster/autoscaling.py) for `autoscaling:`, `RoutingConfig` (pagefleet/cluster/routing/config.py)
for `routing:` (its `policy`) and `router:` (the rest). This module copies none of
it: `EngineSettings`, `AutoscalingSettings` and `RouterSettings` are pydantic models
built from the dataclasses'
`dataclasses.fields()` (`settings_model`), each declared range becoming
pydantic's constraint on that field, so a bad value is reported by its key
(`engine.block_size: Input should be a power of two`,
`autoscaling.max_replicas: Input should be greater than or equal to 1`) and
the generated JSON schema carries every description and range. What spans
fields (`max_replicas >= min_replicas`, the two bands) is left to the
dataclass: `ServeConfig` builds the `AutoscalingPolicyConfig` and reports its
error under `autoscaling:`. What depends on the machine (the checkpoint
directory, the GPUs) is checked when a replica builds its `EngineConfig`.
The dtype names are `pagefleet.settings.DTYPES`, the make-model presets
`make_model.PRESET_NAMES`, the routing policies `routing.ROUTING_POLICIES`.

The models are frozen and hold only what the file says; what a replica works
out at start-up (KV blocks, context length) is returned by the engine
(`ResolvedCapacity`), never written back here.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from pagefleet.cluster.routing.config import (
    DEFAULT_ROUTING_STATS_PERIOD_S,
    RoutingConfig,
    RoutingPolicyName,
)
from pagefleet.engine import EngineConfig
from pagefleet.engine.checkpoint import GENERATION_CONFIG_MODES, is_hub_id
from pagefleet.settings import Setting, declared

from .autoscaling import AutoscalingPolicyConfig
from .model_presets import PRESET_NAMES

_STRICT = ConfigDict(extra="forbid", frozen=True)

# vLLM reads VLLM_API_KEY the same way: the config's api_key wins, else this variable.
API_KEY_ENV = "PAGEFLEET_API_KEY"

PresetName = Literal[PRESET_NAMES]

# EngineConfig's fields that are not under `engine:`: the model and the queue bound are
# top-level keys, and device_visibility is what the deployment decides (under Ray, per rank).
_NOT_ENGINE_SETTINGS = ("model", "max_waiting_requests", "device_visibility")


def _rule_validator(decl: Setting) -> AfterValidator:
    rule = decl.rule
    assert rule is not None

    def check(value: Any) -> Any:
        if value is not None and not rule.test(value):
            raise PydanticCustomError("setting_rule", "Input should be {rule}", {"rule": rule.text})
        return value

    return AfterValidator(check)


def pydantic_field(source: type, name: str, **overrides: Any) -> tuple[Any, Any]:
    """(annotation, FieldInfo) for the dataclass field `source.name`, from its declaration:
    its type (a Literal of its choices, if it has them), default, description and bounds.
    `overrides` replace Field arguments (a different default or description where the
    serving schema means something more specific than the layer's own config)."""
    f = next(f for f in dataclasses.fields(source) if f.name == name)
    decl = declared(f)
    if decl is None:
        raise TypeError(f"{source.__name__}.{name} is not declared with settings.setting")
    hint = typing.get_type_hints(source)[name]
    optional = type(None) in typing.get_args(hint)
    if decl.choices is not None:
        hint = Literal[decl.choices]
        hint = hint | None if optional else hint
    if decl.rule is not None:
        hint = Annotated[hint, _rule_validator(decl)]
    kwargs: dict[str, Any] = {"description": decl.description, **decl.bounds()}
    if f.default is not dataclasses.MISSING:
        kwargs["default"] = f.default
    kwargs.update(overrides)
    return hint, Field(**kwargs)


def declared_field(source: type, name: str, **overrides: Any) -> Any:
    """`pydantic_field`'s FieldInfo alone, for a field of a hand-written model whose
    annotation says the type (a field with a `rule` needs `pydantic_field`'s annotation)."""
    hint, info = pydantic_field(source, name, **overrides)
    if typing.get_origin(hint) is Annotated:
        raise TypeError(f"{source.__name__}.{name} has a rule: use pydantic_field's annotation")
    return info


def settings_model(
    name: str,
    source: type,
    base: type[BaseModel],
    exclude: tuple[str, ...] = (),
    descriptions: dict[str, str] | None = None,
) -> Any:
    """A frozen pydantic model with `source`'s declared fields (all but `exclude`), in
    order, their defaults, ranges and descriptions (`descriptions` replaces some)."""
    descriptions = descriptions or {}
    fields = {
        f.name: pydantic_field(
            source,
            f.name,
            **({"description": descriptions[f.name]} if f.name in descriptions else {}),
        )
        for f in dataclasses.fields(source)
        if f.name not in exclude
    }
    return create_model(name, __base__=base, __module__=__name__, __doc__=base.__doc__, **fields)


class _EngineSettings(BaseModel):
    """`EngineConfig`'s fields by their names (all but `model`, which is top level)."""

    model_config = _STRICT

    def to_engine_config(self, model: str, device_visibility: str = "shared") -> EngineConfig:
        return EngineConfig(model=model, device_visibility=device_visibility, **self.model_dump())


EngineSettings = settings_model(
    "EngineSettings",
    EngineConfig,
    _EngineSettings,
    exclude=_NOT_ENGINE_SETTINGS,
    # Under Ray each rank sees only its own GPU (ServeConfig checks this).
    descriptions={"device": "'cpu' or 'cuda' (each rank on the GPU Ray gives it)"},
)


class _AutoscalingSettings(BaseModel):
    """`pagefleet/cluster/autoscaling.py`'s `AutoscalingPolicyConfig` fields by their names.

    The policy scales out while KV utilisation (each replica's
    `kv_utilization_quantile` over the look-back) stays above
    `target_kv_utilization` (or more than `max_waiting_per_replica` requests
    wait per replica, or the running requests reach `saturated_running_fraction`
    of the batch limit, or compute use passes `target_compute_utilization`) for
    `scale_out_after_s`, and in while it stays below
    `scale_in_kv_utilization` with at most `scale_in_waiting_per_replica`
    waiting for `scale_in_after_s`.
    `upscale_delay_s`, `downscale_delay_s` and `look_back_period_s` are Serve's
    own knobs, applied on top of the policy's decision.
    """

    model_config = _STRICT

    def policy_config(self) -> AutoscalingPolicyConfig:
        return AutoscalingPolicyConfig(**self.model_dump())


AutoscalingSettings = settings_model(
    "AutoscalingSettings", AutoscalingPolicyConfig, _AutoscalingSettings
)


class _RouterSettings(BaseModel):
    """`RoutingConfig`'s fields (all but `policy`, which is `routing:`): the
    most_free_blocks router's weights, caps and memory (docs/routing.md says why each
    default is what it is). They reach each router as Serve's `request_router_kwargs`;
    the other policies read none of them."""

    model_config = _STRICT


RouterSettings = settings_model("RouterSettings", RoutingConfig, _RouterSettings, ("policy",))


class ReplicaResources(BaseModel):
    """What Ray reserves for one rank of an engine replica (all of it at TP=1).

    A replica with `engine.tensor_parallel_size` N is one Ray placement group of N
    such bundles: the replica actor and its engine core (rank 0) take bundle 0,
    rank actors 1..N-1 the others.
    """

    model_config = _STRICT

    num_cpus: float = Field(
        1.0, ge=0, description="CPUs Ray reserves per rank of an engine replica (one bundle)"
    )
    num_gpus: float = Field(
        0.0,
        ge=0,
        description="GPUs Ray reserves per rank of an engine replica: 0 on CPU, 1 per rank "
        "under tensor parallelism on CUDA",
    )
    placement_group_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK",
        description="how Ray places a tensor-parallel replica's bundles over nodes "
        "(STRICT_PACK: all ranks on one node)",
    )


class Limits(BaseModel):
    """What one request may ask for; beyond it the API answers 400 (413 for the body size,
    408 for a body slower than its deadline) naming the limit. The defaults are safe for a
    public endpoint: each bounds the work or memory one request can take (samples, logprob
    tables, stop-string scans, output constraints, JSON depth, fan-out)."""

    model_config = _STRICT

    max_body_bytes: int = Field(
        2 * 1024 * 1024, ge=1024, description="largest request body in bytes (413 beyond)"
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="longest prompt in tokens (default: the model's max_model_len - 1)"
    )
    max_prompts: int = Field(
        32, ge=1, description="most prompts in one completion request (a list of prompts)"
    )
    max_n: int = Field(8, ge=1, description="most samples per request (n and best_of)")
    max_logprobs: int = Field(20, ge=0, le=20, description="most top logprobs per token")
    max_stop: int = Field(
        16, ge=0, description="most stop strings (and, separately, stop token ids) per request"
    )
    max_tokens: int | None = Field(
        None, ge=1, description="most new tokens per request (default: what max_model_len leaves)"
    )
    max_header_bytes: int = Field(
        32 * 1024,
        ge=1024,
        description="most bytes of header fields in one request, each counted as "
        "`name: value\\r\\n` (431 beyond, at Serve's proxy; applied when the proxy starts)",
    )
    max_headers: int = Field(
        100,
        ge=8,
        description="most header fields in one request (431 beyond, at Serve's proxy; "
        "applied when the proxy starts)",
    )
    max_response_bytes: int = Field(
        64 * 1024 * 1024,
        ge=64 * 1024,
        description="largest non-streamed response body a request may ask for, in bytes, "
        "as bounded from its prompts, samples, tokens and logprobs (400 beyond)",
    )
    max_stop_length: int = Field(
        1024, ge=1, description="longest stop string, in characters (400 naming `stop`)"
    )
    max_stop_total_length: int = Field(
        4096, ge=1, description="most characters of all stop strings of a request together"
    )
    max_choices: int = Field(
        1024, ge=1, description="most strings in a choice constraint (guided_choice)"
    )
    max_choice_bytes: int = Field(
        64 * 1024, ge=1, description="most UTF-8 bytes of a choice constraint's strings together"
    )
    max_grammar_bytes: int = Field(
        64 * 1024,
        ge=1,
        description="largest regex, Lark grammar or JSON schema of an output constraint, "
        "in UTF-8 bytes (its canonical JSON text for a schema)",
    )
    constraint_check_timeout_s: float = Field(
        10.0,
        gt=0,
        description="longest wait for an output constraint's check against the vocabulary "
        "(400 beyond)",
    )
    max_json_depth: int = Field(
        64,
        ge=1,
        le=512,
        description="deepest nesting of JSON text the server parses: a request's tool-call "
        "arguments (400 beyond) and the model's tool calls (plain content beyond)",
    )
    body_read_timeout_s: float = Field(
        30.0, gt=0, description="longest a client may take to send a request's body (408 beyond)"
    )


ToolCallParserName = Literal["hermes", "llama3_json", "mistral", "pythonic", "openai"]
ReasoningParserName = Literal["deepseek_r1", "qwen3", "openai_gptoss"]
DEFAULT_CHAT_TEMPLATE_KWARGS = ("enable_thinking", "thinking", "reasoning_effort")


@dataclasses.dataclass(frozen=True)
class ChatSettings:
    """What the ingress reads a chat request and its answer by (`ServeConfig`'s fields)."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template_kwargs_allowed: tuple[str, ...] = DEFAULT_CHAT_TEMPLATE_KWARGS
    disable_additional_properties: bool = True


class Observability(BaseModel):
    """What the ingress tells about each request (`http/observability.py`)."""

    model_config = _STRICT

    request_log: Literal["text", "json", "off"] = Field(
        "text",
        description="one log line per finished request (id, model, status, tokens, TTFT, "
        "e2e, replica) on the `pagefleet.requests` logger: key=value text, JSON, or none",
    )
    otlp_traces_endpoint: str | None = Field(
        None,
        description="OTLP/gRPC endpoint (host:port) that receives traces with vLLM's span "
        "and attribute names: the ingress's span and its route, the replica's llm_request, "
        "and the engine core's engine_core span with its queue, prefill and decode; "
        "none: no traces",
    )


class FairnessSettings(BaseModel):
    """Per-tenant fair queuing at the ingress while the fleet is saturated (`fairness.py`)."""

    model_config = _STRICT

    enabled: bool = Field(
        False,
        description="queue requests at the ingress while the fleet is saturated, ordered by "
        "priority, then by the tenant with the fewest tokens served; off: first come, first served",
    )
    tenant_header: str | None = Field(
        None,
        description="the request header that names the tenant (e.g. x-tenant-id); without it, "
        "or when a request lacks it, the tenant is the API key's hash",
    )
    max_queued_per_tenant: int = Field(
        64, ge=1, description="requests one tenant may have waiting at one ingress; beyond it 429"
    )
    max_in_flight: int | None = Field(
        None,
        ge=1,
        description="requests one ingress lets into the engines at once before it queues "
        "(default: (engine.max_num_seqs + ready_per_replica) x running engine replicas / "
        "ingress_replicas)",
    )
    ready_per_replica: int = Field(
        2,
        ge=0,
        description="requests each engine replica holds beyond its batch, ready for the next "
        "free sequence slot without a round trip to the ingress",
    )
    prompt_token_weight: float = Field(
        1.0, ge=0, description="what one prompt token adds to its tenant's virtual token counter"
    )
    output_token_weight: float = Field(
        2.0, ge=0, description="what one output token adds to its tenant's virtual token counter"
    )


class ResponseStoreSettings(BaseModel):
    """Where `/v1/responses` keeps stored responses: one store for every ingress replica."""

    model_config = _STRICT

    max_entries: int = Field(10_000, ge=1, description="stored responses kept (oldest go first)")
    ttl_s: float = Field(3600.0, gt=0, description="seconds a stored response is kept")


class ServeConfig(BaseModel):
    """A pagefleet deployment: one model served by `replicas` engine replicas."""

    model_config = _STRICT

    model: str = Field(
        description="checkpoint directory (relative paths: to the config file), or a Hugging "
        "Face Hub id (org/name; engine.revision, $HF_TOKEN, the Hub cache, HF_HUB_OFFLINE)"
    )
    served_model_name: str | None = Field(
        None,
        description="the name clients pass as `model` (default: the directory's name, or "
        "the Hub id)",
    )
    make_model: PresetName | None = Field(
        None,
        description="if `model` does not exist, write a seeded random checkpoint of this "
        "preset there first (`pagefleet make-model`)",
    )
    host: str = Field("127.0.0.1", description="HTTP address Serve's proxy listens on")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port")
    replicas: int = Field(1, ge=1, description="engine replicas")
    replica_resources: ReplicaResources = Field(default_factory=ReplicaResources)
    max_waiting_requests: int = declared_field(
        EngineConfig,
        "max_waiting_requests",
        default=192,
        description="requests one engine replica holds waiting for a batch slot; beyond it "
        "(and the queue below) the server answers 429 with Retry-After",
    )
    max_ongoing_requests: int | None = Field(
        None,
        ge=1,
        description="requests Serve sends one replica at once "
        "(default: engine.max_num_seqs + max_waiting_requests)",
    )
    max_queued_requests: int | None = Field(
        None,
        ge=1,
        description="requests each ingress replica holds while every engine replica is full "
        "(Serve's max_queued_requests; default: max_waiting_requests, at least 1); beyond it 429",
    )
    request_timeout_s: float | None = Field(
        600.0,
        gt=0,
        description="a request still unfinished this long after it arrived ends with an error "
        "(408, or an error event in a stream) and its KV blocks are freed; null: no time-out",
    )
    api_key: SecretStr | None = Field(
        None,
        description="if set (or $PAGEFLEET_API_KEY), /v1/*, /tokenize and /detokenize require "
        "`Authorization: Bearer <key>`",
    )
    protect_metrics: bool | None = Field(
        None,
        description="require the API key on /metrics too (default: whenever a key is set; "
        "false opens /metrics to scrapers without it)",
    )
    ingress_replicas: int = Field(1, ge=1, description="replicas of the stateless HTTP ingress")
    routing: RoutingPolicyName = declared_field(RoutingConfig, "policy")
    router: RouterSettings = Field(  # type: ignore[valid-type]
        default_factory=RouterSettings,
        description="the most_free_blocks router's settings (docs/routing.md)",
    )
    routing_stats_period_s: float = Field(
        DEFAULT_ROUTING_STATS_PERIOD_S,
        gt=0,
        description="how often Serve polls each replica's routing stats",
    )
    drain_timeout_s: float = Field(
        60.0,
        ge=0,
        description="a replica being stopped (scale-in, redeploy) waits for its requests at "
        "least this long, and as long as request_timeout_s where that is longer: no request "
        "is cut by a scale-in while it is within its time-out",
    )
    migration_limit: int = Field(
        3,
        ge=0,
        description="times one request may move to another engine replica when its replica "
        "fails or is scaled in (its stream goes on where it was, docs/migration.md); 0: "
        "never, a lost replica's streams end with an error and a scale-in drains for "
        "drain_timeout_s",
    )
    migration_drain_s: float = Field(
        5.0,
        ge=0,
        description="with migration_limit > 0, how long a replica being stopped (scale-in, "
        "redeploy) lets its requests finish before it hands the rest to other replicas",
    )
    autoscaling: AutoscalingSettings | None = Field(
        None, description="KV-utilisation autoscaling; `replicas` is then ignored"
    )
    engine: EngineSettings = Field(default_factory=EngineSettings)
    limits: Limits = Field(default_factory=Limits)
    tool_call_parser: ToolCallParserName | None = Field(
        None,
        description="how `tool_choice: auto` answers are read for calls (vLLM's names); "
        "default: chosen from the chat template",
    )
    reasoning_parser: ReasoningParserName | None = Field(
        None, description="reasoning text moved to `reasoning_content` (vLLM's names); none"
    )
    chat_template_kwargs_allowed: list[str] = Field(
        default_factory=lambda: list(DEFAULT_CHAT_TEMPLATE_KWARGS),
        description="the `chat_template_kwargs` keys a request may set (others: 400)",
    )
    disable_additional_properties: bool = Field(
        True,
        description="JSON schemas as vLLM's default backend reads them: an object lists "
        "all its properties unless it says additionalProperties (false: any extra key)",
    )

    def router_kwargs(self) -> dict[str, Any]:
        """Serve's `request_router_kwargs` for the engine deployment: the `router:`
        settings, for most_free_blocks (the other policies read none). One ingress
        replica's router has no peer to share its view with: it makes no exchanges (and
        no hub actor runs)."""
        if self.routing != "most_free_blocks":
            return {}
        kwargs = self.router.model_dump()
        if self.ingress_replicas == 1:
            kwargs["shared_view_period_s"] = 0.0
        return kwargs

    def chat_settings(self) -> ChatSettings:
        return ChatSettings(
            tool_call_parser=self.tool_call_parser,
            reasoning_parser=self.reasoning_parser,
            chat_template_kwargs_allowed=tuple(self.chat_template_kwargs_allowed),
            disable_additional_properties=self.disable_additional_properties,
        )

    observability: Observability = Field(
        default_factory=Observability, description="the ingress's per-request log"
    )
    fairness: FairnessSettings = Field(
        default_factory=FairnessSettings,
        description="per-tenant fair queuing at the ingress while the fleet is saturated",
    )
    responses: ResponseStoreSettings = Field(
        default_factory=ResponseStoreSettings,
        description="bounds of the stored /v1/responses (shared by every ingress replica)",
    )

    @field_validator("served_model_name")
    @classmethod
    def _name_not_empty(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("served_model_name must not be empty")
        return v

    @model_validator(mode="after")
    def _autoscaling_is_consistent(self) -> ServeConfig:
        if self.autoscaling is not None:
            try:
                self.autoscaling.policy_config()
            except ValueError as e:
                raise ValueError(f"autoscaling: {e}") from None
        return self

    @field_validator("api_key")
    @classmethod
    def _key_not_empty(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and not v.get_secret_value().strip():
            raise ValueError("api_key must not be empty (leave it out for no key)")
        return v

    @model_validator(mode="after")
    def _resources_fit_the_engine(self) -> ServeConfig:
        gpus, tp = self.replica_resources.num_gpus, self.engine.tensor_parallel_size
        device = self.engine.device
        if device.startswith("cuda"):
            if device not in ("cuda", "cuda:0"):
                raise ValueError(
                    f"engine.device {device!r}: under Ray each rank sees only the GPU Ray gives "
                    "it, as cuda:0; use device: cuda"
                )
            if gpus <= 0:
                raise ValueError(
                    "replica_resources.num_gpus must be > 0 with engine.device cuda "
                    "(Ray gives each rank its GPU)"
                )
            if tp > 1 and gpus != 1:
                raise ValueError(
                    f"replica_resources.num_gpus ({gpus:g}) must be 1 with "
                    f"engine.tensor_parallel_size {tp}: it is per rank, and each rank of a "
                    "replica holds one whole GPU"
                )
        else:
            if gpus != 0:
                raise ValueError(
                    f"replica_resources.num_gpus ({gpus:g}) must be 0 with engine.device "
                    f"{device} (set device: cuda to run on GPUs)"
                )
            if tp > 1 and self.replica_resources.num_cpus <= 0:
                raise ValueError(
                    f"replica_resources.num_cpus must be > 0 with engine.tensor_parallel_size "
                    f"{tp} on CPU: each rank is a placement-group bundle, and a bundle "
                    "cannot be empty"
                )
        return self

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return self.model if is_hub_id(self.model) else Path(self.model).name

    def engine_config(self) -> EngineConfig:
        """The engine as a replica runs it: every rank in its own Ray actor (or the
        replica's), seeing only its own GPU; its queue bounded by max_waiting_requests."""
        config = self.engine.to_engine_config(self.model, device_visibility="per_rank")
        return dataclasses.replace(config, max_waiting_requests=self.max_waiting_requests)

    @property
    def replica_max_ongoing_requests(self) -> int:
        """Serve's per-replica cap: what runs plus what may wait, unless set explicitly."""
        if self.max_ongoing_requests is not None:
            return self.max_ongoing_requests
        return self.engine.max_num_seqs + self.max_waiting_requests

    @property
    def ingress_max_queued_requests(self) -> int:
        """Serve's queue at each caller of the engine replicas (its minimum is 1)."""
        if self.max_queued_requests is not None:
            return self.max_queued_requests
        return max(1, self.max_waiting_requests)

    @property
    def drain_s(self) -> float:
        """How long a stopping replica waits for its requests (Serve's graceful shutdown):
        until the longest an accepted request may take, so a scale-in never cuts one
        that is within request_timeout_s."""
        return max(self.drain_timeout_s, self.request_timeout_s or 0.0)

    @property
    def engine_drain_s(self) -> float:
        """How long a stopping engine replica may wait for its requests: with migration,
        migration_drain_s and the hand-off's slack (the ingresses then cut and move what
        is left); without, drain_s."""
        if self.migration_limit == 0:
            return self.drain_s
        return self.migration_drain_s + HAND_OFF_SLACK_S

    def resolved_api_key(self) -> str | None:
        """The key clients must send: the config's, else $PAGEFLEET_API_KEY, else none."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        return os.environ.get(API_KEY_ENV) or None

    def replica_bundles(self) -> list[dict[str, float]] | None:
        """One placement-group bundle per rank, or None at TP=1 (no placement group)."""
        tp = self.engine.tensor_parallel_size
        if tp == 1:
            return None
        res = self.replica_resources
        bundle = {k: v for k, v in (("CPU", res.num_cpus), ("GPU", res.num_gpus)) if v > 0}
        return [dict(bundle) for _ in range(tp)]

    def placement(self) -> dict[str, Any]:
        """The engine deployment's placement options for Serve (none at TP=1)."""
        bundles = self.replica_bundles()
        if bundles is None:
            return {}
        return {
            "placement_group_bundles": bundles,
            "placement_group_strategy": self.replica_resources.placement_group_strategy,
        }


# A stopping replica's wait beyond migration_drain_s: for the ingresses to see it leave,
# cut its streams, and Serve to see them gone.
HAND_OFF_SLACK_S = 30.0


class ConfigError(ValueError):
    pass


def _format(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"{where}: {msg}")
    return "; ".join(lines)


def parse_config(
    data: dict[str, Any], base_dir: str | os.PathLike[str] | None = None
) -> ServeConfig:
    """Validate a config mapping; a relative `model` is resolved against base_dir, unless
    it names a Hub id (`org/name`, nothing there, and no make_model to write it), and so
    is a relative `engine.generation_config` path."""
    if not isinstance(data, dict):
        raise ConfigError("a config is a mapping of keys to values")
    try:
        config = ServeConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"invalid config: {_format(e)}") from None
    if base_dir is not None and not os.path.isabs(config.model):
        local = Path(base_dir) / config.model
        if local.exists() or config.make_model or not is_hub_id(config.model):
            config = config.model_copy(update={"model": str(local.resolve())})
    gen = config.engine.generation_config
    if base_dir is not None and gen not in GENERATION_CONFIG_MODES and not os.path.isabs(gen):
        engine = config.engine.model_copy(
            update={"generation_config": str((Path(base_dir) / gen).resolve())}
        )
        config = config.model_copy(update={"engine": engine})
    return config


def read_config_data(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A config file's mapping, not yet validated."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError("a config is a mapping of keys to values")
    return data or {}


def load_config(path: str | os.PathLike[str]) -> ServeConfig:
    return parse_config(read_config_data(path), base_dir=Path(path).parent)


def engine_field_names() -> set[str]:
    """EngineConfig's user settings under `engine:`: all but the model and the queue bound
    (top level) and what the deployment decides (device_visibility: under Ray, per rank)."""
    return {f.name for f in dataclasses.fields(EngineConfig)} - set(_NOT_ENGINE_SETTINGS)
