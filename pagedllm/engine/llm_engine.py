"""``LLMEngine``: requests in, one scheduled forward pass per ``step()``, outputs out.

One step: the scheduler picks tokens within the budget (decodes first, then prefill
chunks), copy-on-write block copies run, the model runs the flattened batch through the
paged cache, the sampler picks the next token of every sequence that reached its end,
and finished sequences give their blocks back before ``step()`` returns.

Isolation: ``add_request`` refuses (``InvalidRequestError``, nothing queued) a request
whose fields or worst case can never fit this engine. A failure while sampling or
detokenizing one request fails that request alone: it is aborted, its blocks are freed
and its last output carries ``error``; the other requests of the step go on as if it
had not been there.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext

import torch

from pagedllm.attention.selector import attention_backend_for
from pagedllm.config import EngineConfig, KVAllocation, PreemptionMode, same_device
from pagedllm.cpu.allocator import keep_freed_memory
from pagedllm.distributed.executor import TensorParallelExecutor
from pagedllm.distributed.worker import StepWork, WorkerSetup, shared_settings
from pagedllm.engine.cuda_graphs import DecodeGraphs, capture_sizes
from pagedllm.engine.memory_profile import profile_memory
from pagedllm.engine.model_worker import ModelWorker, make_kv_cache
from pagedllm.engine.output_state import SequenceDetokenizer
from pagedllm.engine.outputs import RequestMetrics, RequestOutput
from pagedllm.engine.prompt_logprobs import score_prompt_positions
from pagedllm.request_errors import InvalidRequestError
from pagedllm.engine.request_state import RequestState
from pagedllm.engine.sampler import Sampler, SamplerOutput, SamplingBatch, make_generator
from pagedllm.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.engine.sequence import SequenceStatus, TokenSequence
from pagedllm.engine.stats import EngineStats, StatsLogger, StepTimes
from pagedllm.kv.block_manager import BlockManager
from pagedllm.kv.block_pool import num_reserved_blocks
from pagedllm.kv.capacity import pool_blocks, request_worst_case_blocks
from pagedllm.kv_storage.block_copies import BlockCopies
from pagedllm.kv_storage.kv_cache import KVCache, bytes_per_block
from pagedllm.models.loader import LoadedModel, load_model
from pagedllm.models.weight_bytes import describe_weight_bytes

logger = logging.getLogger("pagedllm")

PromptInput = str | Mapping[str, object]


class LLMEngine:
    """The engine behind :class:`~pagedllm.LLM` and the HTTP server.

    Not thread-safe: one thread calls ``add_request``, ``abort_request`` and ``step``.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """``loaded``: a model already loaded for ``config`` (one rank only)."""
        self.config = config
        self.executor: TensorParallelExecutor | None = None
        if config.tensor_parallel_size > 1:
            if loaded is not None:
                raise ValueError("a preloaded model cannot be split over tensor-parallel ranks")
            if config.device.type == "cuda":
                raise ValueError(
                    "tensor parallelism runs on the CPU (gloo) only for now; use "
                    "tensor_parallel_size=1 on CUDA"
                )
            self.executor = TensorParallelExecutor(config)
        try:
            self._start(loaded)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, loaded: LoadedModel | None) -> None:
        config = self.config
        torch.manual_seed(config.seed)
        keep_freed_memory()
        start = time.monotonic()
        self.device = config.device
        self.loaded = loaded or load_model(
            config.model,
            config.dtype,
            device=self.device,
            load_format=config.load_format,
            quantization=config.quantization,
            linear_kernel=config.linear_kernel,
            parallel=self.executor.group if self.executor else None,
            activation_quantization=config.activation_quantization,
        )
        if self.loaded.model.dtype != config.dtype:
            raise ValueError(
                f"the model was loaded in {self.loaded.model.dtype} but the engine's dtype is "
                f"{config.dtype}; pass the model's dtype to EngineConfig"
            )
        if not same_device(self.loaded.model.device, self.device):
            raise ValueError(
                f"the model was loaded on {self.loaded.model.device} but the engine's device "
                f"is {self.device}; pass the model's device to EngineConfig"
            )
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        if self.tokenizer is not None:
            self.tokenizer = self.tokenizer.with_compact_json(config.disable_any_whitespace)
        logger.info(
            "Loaded %s (%s) in %.2f s; weights %s%s",
            self.loaded.source.name,
            self.model_config.architecture,
            time.monotonic() - start,
            describe_weight_bytes(self.loaded.model),
            f" on rank 0 of {config.tensor_parallel_size}" if self.executor else "",
        )
        self.kv_budget = self._kv_budget()
        # this rank's heads (rank 0 holds the most); block_bytes: one block, every layer
        mc = self.loaded.model.layer_config
        contiguous = config.kv_allocation is KVAllocation.CONTIGUOUS
        # With every layer sliding, blocks out of the window go back to the pool, and the
        # cache keeps one block more than the pool for the tables' null entries.
        window = None if contiguous else mc.kv_window
        self.block_bytes = bytes_per_block(
            mc.num_layers,
            config.block_size,
            mc.num_kv_heads,
            mc.head_dim,
            config.dtype,
            config.kv_cache_dtype,
        )
        self.num_blocks = pool_blocks(self.kv_budget, self.block_bytes, window is not None)
        usable_blocks = self.num_blocks - num_reserved_blocks(
            self.num_blocks, config.reserved_fraction
        )
        self.max_model_len = self._resolve_max_model_len(usable_blocks * config.block_size)
        self.block_manager = BlockManager(
            self.num_blocks,
            config.block_size,
            config.reserved_fraction,
            enable_prefix_caching=config.enable_prefix_caching,
            upfront_tokens=self.max_model_len if contiguous else None,
            sliding_window=window,
        )
        self._log_pool()
        cache_blocks = self.num_blocks + (window is not None)
        swap_blocks = self._swap_blocks()
        self.worker = ModelWorker(
            config, self.loaded.model, cache_blocks, self.max_model_len, swap_blocks
        )
        self.kv_cache, self.runner = self.worker.kv_cache, self.worker.runner
        self.swap_space = self.worker.swap_space
        if self.executor is not None:
            settings = shared_settings(config)
            largest = None
            if not config.disable_custom_all_reduce:  # the embedding's rows, in float32 at most
                largest = config.max_num_batched_tokens * self.model_config.hidden_size * 4
            setup = WorkerSetup(
                settings, cache_blocks, self.max_model_len, swap_blocks, largest
            )
            self.executor.start_ranks(setup)
        attn = self.runner.attn
        if self.device.type == "cuda" and not config.enforce_eager:
            if self.loaded.model.supports_cuda_graphs:
                self.runner.graphs = DecodeGraphs(
                    self.loaded.model,
                    attn,
                    self.max_model_len,
                    config.block_size,
                    capture_sizes(config.max_num_seqs),
                    self.device,
                )
            else:
                logger.info("Decode steps run eagerly: this model's layers cannot be captured")
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
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

    def _make_cache(self, num_blocks: int) -> KVCache:
        return make_kv_cache(self.config, self.loaded.model, num_blocks)

    def _kv_budget(self) -> int:
        """Bytes for the KV pool: the configured size, or on CUDA what the memory
        profile leaves of ``gpu_memory_utilization`` of the device."""
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory
        profile = profile_memory(
            self.loaded.model,
            attention_backend_for,
            self._make_cache,
            self.config.max_num_batched_tokens,
            self.config.max_num_seqs,
            self.config.block_size,
            self.config.gpu_memory_utilization,
            self.device,
        )
        profile.log()
        return profile.kv_budget

    def _swap_blocks(self) -> int:
        """Blocks of the swap space (``swap_space`` bytes, per rank); 0 for none."""
        config, block_bytes = self.config, self.block_bytes
        if config.preemption_mode is PreemptionMode.RECOMPUTE or config.swap_space == 0:
            return 0
        num_blocks = pool_blocks(config.swap_space, block_bytes)
        if num_blocks == 0:
            raise ValueError(
                f"swap_space={config.swap_space} bytes holds no block of {block_bytes} bytes"
            )
        logger.info("Swap space: %d blocks (%d bytes)", num_blocks, num_blocks * block_bytes)
        return num_blocks

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks this engine started (nothing to do without
        them); the engine cannot step afterwards. Idempotent; also run at exit."""
        if self.executor is not None:
            self.executor.shutdown()

    # ---- start-up checks -------------------------------------------------------------

    @property
    def usable_tokens(self) -> int:
        """Slots a normal-priority request can ever hold (the pool less the reserve)."""
        return self.capacity_blocks() * self.config.block_size

    def _resolve_max_model_len(self, fits: int) -> int:
        """``max_model_len`` as configured, or the model's limit capped by ``fits``, the
        slots one normal-priority request can ever hold."""
        model_limit = self.model_config.max_position_embeddings
        requested = self.config.max_model_len
        if requested is not None and requested > model_limit:
            raise ValueError(
                f"max_model_len={requested} exceeds the model's limit of {model_limit} tokens"
            )
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
            f"{self.kv_budget} bytes) cannot hold one request of max_model_len="
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
        if self.block_manager.sliding_window is not None:
            logger.info(
                "Every layer slides over %d tokens: blocks that leave the window go back "
                "to the pool",
                self.block_manager.sliding_window,
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
        """Queue a request; raises ``InvalidRequestError`` (a ValueError) and queues nothing
        if it can never run: a field out of range for this model, ``n`` above
        ``max_n``, a prompt or worst case (every sample at ``max_tokens``) that cannot fit.

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
        self._check_params(params)
        max_tokens = self._check_lengths(len(token_ids), params)
        self._check_fits(len(token_ids), max_tokens, params.n, priority)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        sequences = []
        for index in range(params.n):
            seq = TokenSequence(
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
            sequences.append(SequenceDetokenizer(seq, decoder, self.stop_token_ids, max_tokens))
        self._requests[request_id] = RequestState(
            request_id,
            text,
            token_ids,
            sequences,
            RequestMetrics(arrival_time),
            unforked=sequences[1:],
            prompt_logprobs=None if params.prompt_logprobs is None else [None],
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
                raise InvalidRequestError("this model has no tokenizer; pass prompt_token_ids")
            _check_unicode(prompt)
            return prompt, self._check_ids(self.tokenizer.encode(prompt))
        return None, self._check_ids(prompt)

    def _check_ids(self, token_ids: object) -> list[int]:
        if not isinstance(token_ids, Sequence) or isinstance(token_ids, str):
            raise InvalidRequestError("prompt_token_ids must be a list of integers", "prompt")
        ids = list(token_ids)
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise InvalidRequestError(
                f"prompt token ids must be integers in [0, {vocab})", "prompt"
            )
        return ids

    def _check_params(self, params: SamplingParams) -> None:
        """What ``SamplingParams`` cannot check alone: limits of this engine and model."""
        if params.n > self.config.max_n:
            raise InvalidRequestError(
                f"n must be <= {self.config.max_n} (this engine's max_n), got {params.n}", "n"
            )
        vocab = self.model_config.vocab_size
        outside = [t for t in params.stop_token_ids if t >= vocab]
        if outside:
            raise InvalidRequestError(
                f"stop_token_ids must be token ids in [0, {vocab}), got {outside[0]}",
                "stop_token_ids",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab:
                raise InvalidRequestError(
                    f"{name} must be <= the vocabulary size {vocab}, got {value}", name
                )

    def _check_lengths(self, prompt_len: int, params: SamplingParams) -> int:
        """The request's output token limit, or ValueError when it can never fit."""
        limit = self.max_model_len
        if prompt_len >= limit:
            raise InvalidRequestError(
                f"the prompt is {prompt_len} tokens long, but max_model_len is {limit} "
                "(prompt plus at least one output token must fit)",
                "prompt",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise InvalidRequestError(
                f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) is "
                f"{prompt_len + max_tokens} tokens, beyond max_model_len={limit}",
                "max_tokens",
            )
        if params.min_tokens > max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be <= the {max_tokens} output tokens this prompt leaves, "
                f"got {params.min_tokens}",
                "min_tokens",
            )
        return max_tokens

    def worst_case_blocks(self, prompt_len: int, max_tokens: int, n: int) -> int:
        """Most blocks a request of ``n`` samples (or beams) of a ``prompt_len``-token
        prompt and up to ``max_tokens`` more tokens each holds at once on this engine:
        :func:`~pagedllm.kv.capacity.request_worst_case_blocks` under its allocation mode
        (contiguous: ``max_model_len`` slots up front) and sliding window (a step
        computes at most ``max_num_batched_tokens`` tokens of a sequence)."""
        manager = self.block_manager
        return request_worst_case_blocks(
            prompt_len,
            max_tokens,
            n,
            self.config.block_size,
            upfront_tokens=manager.upfront_tokens,
            window=manager.sliding_window,
            step_tokens=self.config.max_num_batched_tokens,
        )

    def capacity_blocks(self, priority: int = 0) -> int:
        """Blocks one request of ``priority`` may ever hold: the whole pool when
        ``priority < 0``, else the pool less the reserve."""
        pool = self.block_manager.pool
        return pool.num_blocks - (0 if priority < 0 else pool.num_reserved)

    def _check_fits(self, prompt_len: int, max_tokens: int, n: int, priority: int) -> None:
        """Refuse a request whose worst case (:meth:`worst_case_blocks`: all ``n``
        samples reaching ``max_tokens``) holds more blocks than the pool gives its
        priority (:meth:`capacity_blocks`); any other request fits."""
        worst_case = self.worst_case_blocks(prompt_len, max_tokens, n)
        capacity = self.capacity_blocks(priority)
        if worst_case > capacity:
            raise InvalidRequestError(
                f"n={n} samples of up to {prompt_len + max_tokens} tokens each may need "
                f"{worst_case} KV blocks, but the pool holds {capacity} for this request; "
                "lower n or max_tokens",
                "n" if n > 1 else "max_tokens",
            )

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
                self.scheduler.finish_unscheduled(seq, SequenceStatus.FINISHED_ABORTED)
            else:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
            seq.finished_time = now

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # ---- one step --------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; return the requests that produced tokens or finished (only
        finished ones for requests whose ``output_kind`` is FINAL_ONLY)."""
        times = self.step_times
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        times.schedule += time.perf_counter() - t0
        if plan.is_empty:
            return []
        return self.run_plan(plan)

    def run_plan(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """The rest of :meth:`step` after scheduling: execute ``plan`` (from
        ``scheduler.schedule()``), sample, and return the requests it touched."""
        times = self.step_times
        ending, logits = self.execute_plan(plan)
        t1 = time.perf_counter()
        sampling, logits = self._fork_parallel_samples(ending, logits)
        sampled, failures = self._sample_isolated(sampling, logits)
        t2 = time.perf_counter()
        outputs = self._process(sampling, sampled, failures)
        times.sample += t2 - t1
        times.postprocess += time.perf_counter() - t2
        times.steps += 1
        self._generation_tokens_total += len(sampling)
        self._last_batched_tokens = plan.num_batched_tokens
        self._max_concurrent = max(self._max_concurrent, len(plan.scheduled))
        if self._stats_logger.due():
            self._stats_logger.log(self.get_stats())
        return outputs

    def execute_plan(self, plan: SchedulerOutput) -> tuple[list[TokenSequence], torch.Tensor]:
        """Run a scheduler plan through the model: apply its block copies, write and attend
        K/V, then hand the result back to the scheduler.

        Returns the sequences whose known tokens are now all computed (plan order) and
        their float32 next-token logits ``[len(sequences), vocab]``.
        """
        times = self.step_times
        t0 = time.perf_counter()
        copies = BlockCopies(plan.swap_out, plan.swap_in, plan.block_copies)
        batch = self.runner.build_batch(plan)
        t1 = time.perf_counter()
        executor = self.executor
        with executor.guard() if executor else nullcontext():
            if executor is not None:
                executor.send_step(StepWork.of(copies, batch))
            output = self.worker.execute(copies, batch)
            if batch.prompt_spans:
                self._record_prompt_logprobs(batch.prompt_spans, output.prompt_hidden)
        times.prepare += t1 - t0
        times.forward += time.perf_counter() - t1
        return self.scheduler.update_from_output(plan), output.logits

    def _record_prompt_logprobs(
        self, spans: list[tuple[TokenSequence, range]], hidden: torch.Tensor
    ) -> None:
        """Score the prompt positions this pass computed for requests that asked."""
        compute_logits = self.loaded.model.compute_logits
        for seq, entries in score_prompt_positions(compute_logits, hidden, spans):
            self._requests[seq.request_id].prompt_logprobs.extend(entries)

    def _fork_parallel_samples(
        self, sampling: list[TokenSequence], logits: torch.Tensor
    ) -> tuple[list[TokenSequence], torch.Tensor]:
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
                self.scheduler.fork(seq, child)
                forked.append(child)
                rows.append(row)
            state.unforked = []
        if len(forked) == len(sampling):
            return sampling, logits
        return forked, logits[torch.tensor(rows)]

    def _sample(self, sampling: list[TokenSequence], logits: torch.Tensor):
        if not sampling:
            return None
        batch = SamplingBatch.from_requests(
            [seq.params for seq in sampling],
            [seq.prompt_token_ids for seq in sampling],
            [seq.output_token_ids for seq in sampling],
            [seq.generator for seq in sampling],
            self.stop_token_ids,
            device=logits.device,
        )
        return self.sampler(logits, batch)

    def _sample_isolated(
        self, sampling: list[TokenSequence], logits: torch.Tensor
    ) -> tuple[SamplerOutput | None, dict[str, Exception]]:
        """The batch's tokens and the requests whose sampling failed.

        If sampling the whole batch raises, every row is sampled again on its own (seeded
        generators rewound first), so the rows that do not fail get the tokens they get
        in the batch, and a failing row fails only its request.
        """
        if not sampling:
            return None, {}
        seeded = [(seq.generator, seq.generator.get_state()) for seq in sampling if seq.generator]
        try:
            return self._sample(sampling, logits), {}
        except Exception:
            logger.exception("sampling a batch of %d rows failed; sampling rows apart", len(logits))
        for generator, state in seeded:
            generator.set_state(state)
        token_ids: list[int | None] = []
        logprobs: list = []
        failures: dict[str, Exception] = {}
        for row, seq in enumerate(sampling):
            one = None
            if seq.request_id not in failures:
                try:
                    one = self._sample([seq], logits[row : row + 1])
                except Exception as error:
                    failures[seq.request_id] = error
            token_ids.append(one.token_ids[0] if one else None)
            logprobs.append(one.logprobs[0] if one and one.logprobs else None)
        return SamplerOutput(token_ids, logprobs), failures

    def _process(
        self,
        sampling: list[TokenSequence],
        sampled: SamplerOutput | None,
        failures: dict[str, Exception],
    ) -> list[RequestOutput]:
        """Record each row's token; a request whose row raises (or whose sampling failed,
        ``failures``) is failed alone. Returns the outputs of every request touched
        (a FINAL_ONLY request's only when it finished)."""
        if sampled is None:
            return []
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        for row, seq in enumerate(sampling):
            if seq.request_id in failures:
                continue
            state = self._requests[seq.request_id]
            out = state.sequences[seq.index]
            logprobs = sampled.logprobs[row] if sampled.logprobs is not None else None
            try:
                status = out.add_token(sampled.token_ids[row], logprobs)
            except Exception as error:
                failures[seq.request_id] = error
                touched.pop(seq.request_id, None)
                continue
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
                # vLLM's prompt_tokens_total: each request's whole prompt, once, when
                # its first token comes (cached tokens count, recomputed ones do not)
                self._prompt_tokens_total += len(state.prompt_token_ids)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if status is not None:
                self.scheduler.finish(seq, status)
                seq.finished_time = now
            touched[seq.request_id] = state
        outputs = []
        for request_id, state in touched.items():
            finished = state.finished
            if not finished and state.output_kind is RequestOutputKind.FINAL_ONLY:
                continue
            state.metrics.num_output_tokens = sum(o.seq.num_output_tokens for o in state.sequences)
            if finished:
                state.metrics.finished_time = now
                del self._requests[request_id]
            outputs.append(state.output())
        outputs.extend(self._fail(request_id, error) for request_id, error in failures.items())
        return outputs

    def _fail(self, request_id: str, error: Exception) -> RequestOutput:
        """Abort a request that raised inside the step; its final output names the error."""
        logger.error("request %s failed: %r", request_id, error, exc_info=error)
        state = self._requests[request_id]
        self.abort_request(request_id)
        state.error = f"{type(error).__name__}: {error}"
        state.metrics.num_output_tokens = sum(o.seq.num_output_tokens for o in state.sequences)
        state.metrics.finished_time = time.monotonic()
        return state.output()

    # ---- monitoring ------------------------------------------------------------------

    def get_stats(self) -> EngineStats:
        bm = self.block_manager.stats()
        pool = bm.pool
        return EngineStats(
            # requests, as vLLM counts them (an n > 1 request runs several sequences)
            num_running=len({seq.request_id for seq in self.scheduler.running}),
            num_waiting=len({seq.request_id for seq in self.scheduler.waiting}),
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


def _check_unicode(text: str) -> None:
    """Refuse text a tokenizer cannot encode: lone UTF-16 surrogates (``"\\udc00"``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequestError(
            f"the prompt is not valid Unicode: a lone surrogate {text[error.start]!r} at "
            f"character {error.start}",
            "prompt",
        ) from None
