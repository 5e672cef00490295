"""``LLMEngine``: requests in, one scheduled forward pass per ``step()``, outputs out.

One step: the scheduler picks tokens within the budget (decodes first, then prefill
chunks), copy-on-write block copies run, the model runs the flattened batch through the
paged cache, the sampler picks the next token of every sequence that reached its end,
and finished sequences give their blocks back before ``step()`` returns.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping, Sequence

import torch

from pagedllm.attention.paged_backend import PagedAttentionBackend
from pagedllm.config import EngineConfig
from pagedllm.cpu.allocator import keep_freed_memory
from pagedllm.engine.model_runner import ModelRunner
from pagedllm.engine.output_state import SequenceOutput
from pagedllm.engine.outputs import RequestMetrics, RequestOutput
from pagedllm.engine.request_state import RequestState
from pagedllm.engine.sampler import Sampler, SamplingBatch, make_generator
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.engine.sequence import Sequence as Seq
from pagedllm.engine.sequence import SequenceStatus
from pagedllm.engine.stats import EngineStats, StatsLogger, StepTimes
from pagedllm.kv.block_manager import BlockManager
from pagedllm.kv.kv_cache import KVCache, num_blocks_for_budget
from pagedllm.kv.swap_space import SwapSpace
from pagedllm.models.loader import LoadedModel, load_model

logger = logging.getLogger("pagedllm")

PromptInput = str | Mapping[str, object]


class LLMEngine:
    """The engine behind :class:`~pagedllm.LLM` and the HTTP server.

    Not thread-safe: one thread calls ``add_request``, ``abort_request`` and ``step``.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        keep_freed_memory()
        start = time.monotonic()
        self.loaded = loaded or load_model(config.model, config.dtype)
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        logger.info(
            "Loaded %s (%s) in %.2f s",
            self.loaded.source.name,
            self.model_config.architecture,
            time.monotonic() - start,
        )
        mc = self.model_config
        self.num_blocks = num_blocks_for_budget(
            config.kv_cache_memory,
            mc.num_layers,
            config.block_size,
            mc.num_kv_heads,
            mc.head_dim,
            config.dtype,
            config.kv_cache_dtype,
        )
        self.block_manager = BlockManager(
            self.num_blocks,
            config.block_size,
            config.reserved_fraction,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        self.max_model_len = self._resolve_max_model_len()
        self._log_pool()
        self.kv_cache = KVCache(
            mc.num_layers,
            self.num_blocks,
            config.block_size,
            mc.num_kv_heads,
            mc.head_dim,
            config.dtype,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        self.runner = ModelRunner(
            self.loaded.model, PagedAttentionBackend(self.kv_cache), self.block_manager
        )
        self.swap_space = self._make_swap_space()
        reserve = self.max_model_len if config.kv_allocation == "contiguous" else None
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            reserve,
            cache_key=f"{self.loaded.source}:{config.dtype}",
            swap_space=self.swap_space,
            preemption_mode=config.preemption_mode,
        )
        self.sampler = Sampler()
        self._requests: dict[str, RequestState] = {}
        self._request_counter = itertools.count()
        self._prompt_tokens_total = 0
        self._generation_tokens_total = 0
        self._last_batched_tokens = 0
        self._max_concurrent = 0
        self.step_times = StepTimes()
        self._stats_logger = StatsLogger(config.log_stats_interval)

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> LLMEngine:
        return cls(EngineConfig(**kwargs))

    def _make_swap_space(self) -> SwapSpace | None:
        config = self.config
        if config.preemption_mode == "recompute" or config.swap_space == 0:
            return None
        block_bytes = self.kv_cache.nbytes // max(self.num_blocks, 1)
        num_blocks = config.swap_space // block_bytes
        if num_blocks == 0:
            raise ValueError(
                f"swap_space={config.swap_space} bytes holds no block of {block_bytes} bytes"
            )
        logger.info("Swap space: %d blocks (%d bytes)", num_blocks, num_blocks * block_bytes)
        return SwapSpace(self.kv_cache, num_blocks, config.swap_path)

    # ---- start-up checks -------------------------------------------------------------

    @property
    def usable_tokens(self) -> int:
        """Slots a normal-priority request can ever hold (the pool less the reserve)."""
        return self.block_manager.pool.num_available(high_priority=False) * self.config.block_size

    def _resolve_max_model_len(self) -> int:
        model_limit = self.model_config.max_position_embeddings
        requested = self.config.max_model_len
        if requested is not None and requested > model_limit:
            raise ValueError(
                f"max_model_len={requested} exceeds the model's limit of {model_limit} tokens"
            )
        fits = self.usable_tokens
        if requested is None:
            if fits < min(model_limit, 2):
                raise ValueError(self._pool_too_small_message(model_limit, fits))
            return min(model_limit, fits)
        if requested > fits:
            raise ValueError(self._pool_too_small_message(requested, fits))
        return requested

    def _pool_too_small_message(self, wanted: int, fits: int) -> str:
        return (
            f"The KV cache pool ({self.num_blocks} blocks of {self.config.block_size} tokens, "
            f"{self.config.kv_cache_memory} bytes) cannot hold one request of max_model_len="
            f"{wanted} tokens. The largest max_model_len that fits is {fits}; "
            "lower max_model_len or raise kv_cache_memory."
        )

    def _log_pool(self) -> None:
        pool_tokens = self.num_blocks * self.config.block_size
        logger.info(
            "KV cache pool: %d blocks x %d tokens = %d tokens (%d reserved blocks), "
            "max_model_len %d, maximum concurrency at max_model_len: %.2fx",
            self.num_blocks,
            self.config.block_size,
            pool_tokens,
            self.block_manager.pool.num_blocks - self.block_manager.pool.num_available(False),
            self.max_model_len,
            self.usable_tokens / self.max_model_len,
        )

    # ---- requests --------------------------------------------------------------------

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptInput | Sequence[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request; raises ValueError (and queues nothing) if it can never run.

        ``prompt``: text, a list of token ids, ``{"prompt": text}`` or
        ``{"prompt_token_ids": [...]}``. Returns the request id. With ``n > 1`` only the
        first sequence is queued; the others fork from it once the prompt is prefilled,
        sharing its blocks. Requests with different ``cache_salt`` never share cached
        blocks.
        """
        params = params or SamplingParams()
        request_id = str(next(self._request_counter)) if request_id is None else request_id
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize_prompt(prompt)
        max_tokens = self._check_lengths(len(token_ids), params)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        sequences = []
        for index in range(params.n):
            seq = Seq(
                request_id=request_id,
                prompt_token_ids=token_ids,
                params=params,
                arrival_time=arrival_time,
                priority=priority,
                index=index,
                cache_salt=cache_salt,
                generator=make_generator(params.derived_seed(index)),
            )
            decoder = self.tokenizer.incremental_decoder(token_ids) if self.tokenizer else None
            sequences.append(SequenceOutput(seq, decoder, self.stop_token_ids, max_tokens))
        self._requests[request_id] = RequestState(
            request_id,
            text,
            token_ids,
            sequences,
            RequestMetrics(arrival_time),
            unforked=sequences[1:],
        )
        self.scheduler.add(sequences[0].seq)
        return request_id

    @property
    def stop_token_ids(self) -> set[int]:
        """Token ids that end generation (the model's EOS and end-of-turn ids)."""
        if self.tokenizer is not None:
            return self.tokenizer.stop_token_ids
        return set(self.model_config.eos_token_ids)

    def tokenize_prompt(self, prompt: PromptInput | Sequence[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompt_token_ids")
            return prompt, self._check_ids(self.tokenizer.encode(prompt))
        return None, self._check_ids(prompt)

    def _check_ids(self, token_ids: object) -> list[int]:
        if not isinstance(token_ids, Sequence) or isinstance(token_ids, str):
            raise ValueError("prompt_token_ids must be a list of integers")
        ids = list(token_ids)
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return ids

    def _check_lengths(self, prompt_len: int, params: SamplingParams) -> int:
        """The request's output token limit, or ValueError when it can never fit."""
        limit = self.max_model_len
        if prompt_len >= limit:
            raise ValueError(
                f"the prompt is {prompt_len} tokens long, but max_model_len is {limit} "
                "(prompt plus at least one output token must fit)"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise ValueError(
                f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) is "
                f"{prompt_len + max_tokens} tokens, beyond max_model_len={limit}"
            )
        return max_tokens

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks now; unknown or finished ids are ignored."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        now = time.monotonic()
        for out in state.sequences:
            seq = out.seq
            if seq.is_finished:
                continue
            if out in state.unforked:
                seq.status = SequenceStatus.FINISHED_ABORTED
            else:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            seq.finished_time = now

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ---- one step --------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the requests that produced tokens or finished."""
        times = self.step_times
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        times.schedule += time.perf_counter() - t0
        if plan.is_empty:
            return []
        ending, logits = self.execute_plan(plan)
        t1 = time.perf_counter()
        sampling, logits = self._fork_parallel_samples(ending, logits)
        sampled = self._sample(sampling, logits)
        t2 = time.perf_counter()
        outputs = self._process(sampling, sampled)
        times.sample += t2 - t1
        times.postprocess += time.perf_counter() - t2
        times.steps += 1
        self._prompt_tokens_total += plan.num_batched_tokens - len(ending)
        self._generation_tokens_total += len(sampling)
        self._last_batched_tokens = plan.num_batched_tokens
        self._max_concurrent = max(self._max_concurrent, len(plan.scheduled))
        if self.config.log_stats_interval > 0:
            self._stats_logger.maybe_log(self.get_stats())
        return outputs

    def execute_plan(self, plan: SchedulerOutput) -> tuple[list[Seq], torch.Tensor]:
        """Run a scheduler plan through the model: copy blocks on write, write and attend
        K/V, commit the written tokens to the prefix cache.

        Returns the sequences whose known tokens are now all computed (plan order) and
        their float32 next-token logits ``[len(sequences), vocab]``.
        """
        times = self.step_times
        t0 = time.perf_counter()
        if plan.block_copies:
            self.kv_cache.copy_blocks(plan.block_copies)
        input_ids, positions, metadata, sample_rows = self.runner.build_batch(plan.scheduled)
        t1 = time.perf_counter()
        logits = self.runner.forward(input_ids, positions, metadata, sample_rows)
        times.prepare += t1 - t0
        times.forward += time.perf_counter() - t1
        ending = [item.seq for item in plan.scheduled if item.samples]
        for item in plan.scheduled:
            seq = item.seq
            start = seq.num_computed_tokens
            self.block_manager.commit_tokens(
                seq.seq_id, seq.all_token_ids[start : start + item.num_tokens]
            )
            seq.num_computed_tokens += item.num_tokens
        return ending, logits

    def _fork_parallel_samples(
        self, sampling: list[Seq], logits: torch.Tensor
    ) -> tuple[list[Seq], torch.Tensor]:
        """Start the other n - 1 samples of requests whose prompt was just prefilled.

        Each fork shares every block of the first sequence (nothing is copied now; the
        partly filled last block is copied on its first write) and samples its first
        token from the same logits row with its own generator.
        """
        rows = list(range(len(sampling)))
        forked = list(sampling)
        for row, seq in enumerate(sampling):
            state = self._requests[seq.request_id]
            if seq.index != 0 or not state.unforked:
                continue
            for out in state.unforked:
                child = out.seq
                self.block_manager.fork(seq.seq_id, child.seq_id)
                child.num_computed_tokens = seq.num_computed_tokens
                child.status = SequenceStatus.RUNNING
                self.scheduler.running.append(child)
                forked.append(child)
                rows.append(row)
            state.unforked = []
        if len(forked) == len(sampling):
            return sampling, logits
        return forked, logits[torch.tensor(rows)]

    def _sample(self, sampling: list[Seq], logits: torch.Tensor):
        if not sampling:
            return None
        batch = SamplingBatch.from_requests(
            [seq.params for seq in sampling],
            [seq.prompt_token_ids for seq in sampling],
            [seq.output_token_ids for seq in sampling],
            [seq.generator for seq in sampling],
            self.tokenizer.eos_token_id if self.tokenizer else None,
        )
        return self.sampler(logits, batch)

    def _process(self, sampling: list[Seq], sampled) -> list[RequestOutput]:
        if sampled is None:
            return []
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        for row, seq in enumerate(sampling):
            state = self._requests[seq.request_id]
            out = state.sequences[seq.index]
            logprobs = sampled.logprobs[row] if sampled.logprobs is not None else None
            status = out.add_token(sampled.token_ids[row], logprobs)
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            if seq.first_token_time is None:
                seq.first_token_time = now
            if status is not None:
                self.scheduler.finish(seq, status)
                seq.finished_time = now
            touched[seq.request_id] = state
        outputs = []
        for request_id, state in touched.items():
            state.metrics.num_output_tokens = sum(o.seq.num_output_tokens for o in state.sequences)
            if state.finished:
                state.metrics.finished_time = now
                del self._requests[request_id]
            outputs.append(state.output())
        return outputs

    # ---- monitoring ------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        bm = self.block_manager.stats()
        pool = bm.pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preempted_waiting=self.scheduler.num_preempted_waiting,
            num_preemptions_total=self.scheduler.num_preemptions,
            num_blocks_total=pool.num_blocks,
            num_blocks_used=pool.used,
            num_blocks_free=pool.free,
            num_blocks_reserved=pool.reserved,
            peak_blocks_used=pool.peak_used,
            kv_cache_usage=pool.usage,
            internal_fragmentation_slots=bm.fragmentation.internal_fragmentation_slots,
            slots_saved_by_sharing=bm.fragmentation.slots_saved_by_sharing,
            num_blocks_shared=pool.shared,
            num_blocks_cached=pool.cached,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            prompt_tokens_total=self._prompt_tokens_total,
            generation_tokens_total=self._generation_tokens_total,
            num_batched_tokens=self._last_batched_tokens,
            max_concurrent_seqs=self._max_concurrent,
            step_times=self.step_times,
            num_swapped=len(self.scheduler.swapped),
            swap=self.swap_space.stats() if self.swap_space is not None else None,
        )
