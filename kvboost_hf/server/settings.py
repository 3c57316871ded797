"""Settings of the OpenAI-compatible server (what ``kvboost-hf serve`` flags set)."""

from __future__ import annotations

from dataclasses import dataclass

from kvboost_hf.reuse.repair import STRATEGIES

DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # 16 prompts of 32k token ids fit
DEFAULT_GRAMMAR_CACHE_BYTES = 512 * 2**20  # vLLM's default for xgrammar's cache (VLLM_XGRAMMAR_CACHE_MB)
DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S = 5.0  # Gemma-3's 262k vocabulary: 1.2-1.6 s for a 4-field object schema
DEFAULT_GRAMMAR_COMPILE_SLOTS = 2

# "exact": exact prefix reuse only (token-identical replies); the others also reuse stored
# chunks found anywhere in the prompt, repaired by that strategy (approximate).
RECOMPUTE_STRATEGIES: tuple[str, ...] = ("exact", *STRATEGIES)


@dataclass
class ServerSettings:
    """How the app serves one model.

    ``max_prompt_tokens`` (None: the model's context) and the model's
    ``max_position_embeddings`` bound prompts; ``max_queue`` is the number of requests that
    may wait behind the running one; ``request_timeout`` (seconds, queueing included) bounds a
    request; ``default_max_tokens`` caps chat replies that set no ``max_tokens``.
    ``reuse=False`` serves without ``enable_chunk_reuse`` (for A/B measurements).
    ``workers`` requests run at once, each in its own ``model.generate`` call; ``torch_threads``
    (None: leave torch's setting) is applied with ``torch.set_num_threads`` while the app runs
    (process wide) and restored at shutdown. ``plan_memory`` predicts each request's peak
    memory and refuses (413) or, with ``auto_truncate``, truncates what cannot fit into
    ``memory_limit`` bytes (None: CUDA free memory, or the cgroup limit / physical memory).
    ``kv_bits_fallback`` (e.g. ``(8, 4)``) lets a request that fits no full-precision rung run
    with its live K/V quantized to those bits instead (approximate, without reuse; reported in
    the ``X-Kvboost-KV-Bits`` header); empty (the default) keeps every reply exact.
    ``scheduler`` is ``"workers"`` (the above) or ``"batch"``: continuous batching, at most
    ``max_batch_size`` requests decoded together, at most ``max_batched_tokens`` tokens forwarded
    per step (one per decoding request, the rest prompt chunks); ``workers`` is then unused.
    What a client can make the server do is bounded too: request bodies of ``/v1`` and the tokenizer
    routes to ``max_body_bytes`` (413); compiled grammars cached to ``grammar_cache_bytes``; a
    schema's compile to ``grammar_compile_timeout`` seconds (400), with at most
    ``grammar_compile_slots`` compiles running at once (503 when none frees in time).
    ``api_key`` is the one key of a one-tenant server; ``api_keys_file`` instead names a JSON file of
    keys and the tenants they belong to (:mod:`kvboost_hf.server.api.keys`), each tenant's entries
    its own in every tier.
    """

    model_name: str = "kvboost-hf"
    api_key: str | None = None
    api_keys_file: str | None = None
    reuse: bool = True
    max_prompt_tokens: int | None = None
    max_queue: int = 64
    request_timeout: float = 600.0
    default_max_tokens: int = 256
    recompute_strategy: str = "exact"
    workers: int = 1
    torch_threads: int | None = None
    plan_memory: bool = True
    memory_limit: int | None = None
    auto_truncate: bool = False
    kv_bits_fallback: tuple[int, ...] = ()
    scheduler: str = "workers"
    max_batch_size: int = 32
    max_batched_tokens: int = 160
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    grammar_cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES
    grammar_compile_timeout: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S
    grammar_compile_slots: int = DEFAULT_GRAMMAR_COMPILE_SLOTS

    def __post_init__(self) -> None:
        if self.recompute_strategy not in RECOMPUTE_STRATEGIES:
            raise ValueError(
                f"recompute_strategy must be one of {', '.join(RECOMPUTE_STRATEGIES)}, got {self.recompute_strategy!r}"
            )
        for name in ("max_prompt_tokens", "default_max_tokens", "torch_threads", "max_body_bytes",
                     "grammar_cache_bytes", "grammar_compile_slots"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers must be a positive int, got {self.workers!r}")
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise ValueError(f"max_queue must be a non-negative int, got {self.max_queue!r}")
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be positive, got {self.request_timeout!r}")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be positive, got {self.grammar_compile_timeout!r}")
        if self.memory_limit is not None and (not isinstance(self.memory_limit, int) or self.memory_limit < 1):
            raise ValueError(f"memory_limit must be a positive number of bytes, got {self.memory_limit!r}")
        if any(b not in (8, 4) for b in self.kv_bits_fallback):
            raise ValueError(f"kv_bits_fallback may hold 8 and 4, got {list(self.kv_bits_fallback)}")
        if self.scheduler not in ("batch", "workers"):
            raise ValueError(f"scheduler must be 'batch' or 'workers', got {self.scheduler!r}")
        if self.scheduler == "batch":
            from kvboost_hf.batching import BatchLimits  # noqa: PLC0415 - validates the two limits

            BatchLimits(self.max_batch_size, self.max_batched_tokens)
        if self.api_key == "":
            self.api_key = None
        if self.api_key is not None and self.api_keys_file is not None:
            raise ValueError("give one of api_key (one tenant) or api_keys_file (tenants), not both")
