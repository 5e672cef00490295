"""``LLMEngine``: requests in, one scheduled forward pass per ``step()``, outputs out.

One step: the scheduler picks tokens within the budget (decodes first, then prefill
chunks), copy-on-write block copies run, the model runs the flattened batch through the
paged cache, the sampler picks the next token of every sequence that reached its end,
and finished sequences give their blocks back before ``step()`` returns. With
``speculative_config``, sequences also run the tokens guessed for them; the model's
rows verify the guesses (:mod:`~pagedllm.engine.spec_verify`), the kept ones join the
sequence with the model's next token, and the rest are rolled back
(:mod:`~pagedllm.engine.speculation`).

Isolation: ``add_request`` refuses (``InvalidRequestError``, nothing queued) a request
whose fields or worst case can never fit this engine. A failure while sampling or
detokenizing one request fails that request alone: it is aborted, its blocks are freed
and its last output carries ``error``; the other requests of the step go on as if it
had not been there.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import time
from collections.abc import Sequence
from contextlib import nullcontext

import torch

from pagedllm.config import EngineConfig
from pagedllm.engine.draft_proposer import DraftGuesses
from pagedllm.engine.engine_builder import build_engine, start_executor
from pagedllm.engine.output_state import SequenceDetokenizer
from pagedllm.engine.outputs import RequestMetrics, RequestOutput
from pagedllm.engine.prompt_logprobs import score_prompt_positions
from pagedllm.engine.request_state import RequestState
from pagedllm.engine.request_validator import PromptInput, RequestValidator
from pagedllm.engine.sampler import Sampler, SamplerOutput, make_generator
from pagedllm.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.engine.scheduler import SchedulerOutput
from pagedllm.engine.sequence import SequenceStatus, TokenSequence
from pagedllm.engine.speculation import Speculator, StepRows, merged_rows
from pagedllm.engine.stats import (
    EngineStats,
    StatsLogger,
    StepTimes,
    TokenCounters,
    gather_stats,
)
from pagedllm.engine.step_sampling import sample_isolated, verify_isolated
from pagedllm.engine.tensor_parallel.worker import StepWork
from pagedllm.kv_storage.block_copies import BlockCopies
from pagedllm.models.loader import LoadedModel

PREFILL_RATE_MIN_TOKENS = 128
"""Steps of at least this many tokens measure the prefill rate the lower tiers compare
their disk reads against (decode steps would understate it)."""

LOAD_WAIT_SECONDS = 0.05
"""Longest a step with nothing to run blocks for a disk load to end (then schedules
again)."""

logger = logging.getLogger("pagedllm")


class LLMEngine:
    """The engine behind :class:`~pagedllm.LLM` and the HTTP server: the step loop over
    the parts :mod:`~pagedllm.engine.engine_builder` assembles, admitting requests
    through :mod:`~pagedllm.engine.request_validator`.

    Not thread-safe: one thread calls ``add_request``, ``abort_request`` and ``step``.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """``loaded``: a model already loaded for ``config`` (one rank only). The parts
        come from :func:`~pagedllm.engine.engine_builder.build_engine`."""
        self.config = config
        self.device = config.device
        self.executor = start_executor(config, loaded)
        self.tiers = None
        try:
            parts = build_engine(config, loaded, self.executor)
        except BaseException:
            self.shutdown()
            raise
        self.loaded, self.model_config = parts.loaded, parts.loaded.config
        self.tokenizer = parts.tokenizer
        self.kv_budget, self.block_bytes = parts.kv_budget, parts.block_bytes
        self.num_blocks, self.max_model_len = parts.num_blocks, parts.max_model_len
        self.block_manager, self.scheduler = parts.block_manager, parts.scheduler
        self.worker, self.drafter = parts.worker, parts.drafter
        self.kv_cache, self.runner = self.worker.kv_cache, self.worker.runner
        self.swap_space = self.worker.swap_space
        self.tiers = self.worker.tiers
        if self.tiers is not None:
            atexit.register(self.shutdown)  # cached blocks reach kv_cache_dir at exit
        self.validator = RequestValidator(
            config,
            self.model_config.vocab_size,
            self.tokenizer,
            self.max_model_len,
            self.block_manager,
        )
        self.sampler = Sampler()
        spec = config.speculative_config
        self.speculator = None
        if spec is not None:
            drafts = None
            if self.drafter is not None:
                drafts = DraftGuesses(
                    spec,
                    self.drafter,
                    self.block_manager,
                    self.stop_token_ids,
                    config.max_num_batched_tokens,
                )
            self.speculator = Speculator(spec, drafts)
        self._requests: dict[str, RequestState] = {}
        self._request_counter = itertools.count()
        self.counters = TokenCounters()
        self.step_times = StepTimes()
        self._stats_logger = StatsLogger(config.log_stats_interval)

    def shutdown(self) -> None:
        """Write the prefix cache's blocks to ``kv_cache_dir`` (if set) and stop the
        tensor-parallel ranks this engine started; the engine cannot step afterwards.
        Idempotent; also run at exit."""
        if self.tiers is not None:
            atexit.unregister(self.shutdown)
            if self.worker.swap_space is not None:  # its last read-ahead is in the pool
                self.worker.swap_space.finish_read_ahead()
            tiers, self.tiers = self.tiers, None
            written = tiers.persist(self.block_manager.pool.cached_blocks())
            tiers.close()
            if written:
                logger.info("KV tiers: %d cached blocks written to disk at shutdown", written)
        if self.executor is not None:
            self.executor.shutdown()

    @property
    def usable_tokens(self) -> int:
        """Slots a normal-priority request can ever hold (the pool less the reserve)."""
        return self.capacity_blocks() * self.config.block_size

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
        max_tokens = self.validator.check(len(token_ids), params, priority)
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
        """:meth:`RequestValidator.tokenize_prompt`: the text and its checked token ids."""
        return self.validator.tokenize_prompt(prompt)

    def worst_case_blocks(self, prompt_len: int, max_tokens: int, n: int) -> int:
        """:meth:`RequestValidator.worst_case_blocks`: a request's most blocks at once."""
        return self.validator.worst_case_blocks(prompt_len, max_tokens, n)

    def capacity_blocks(self, priority: int = 0) -> int:
        """:meth:`RequestValidator.capacity_blocks`: blocks one request may ever hold."""
        return self.validator.capacity_blocks(priority)

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
            if self.speculator is not None:
                self.speculator.finished(seq, completed=False)

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
            if self.tiers is not None and self.tiers.loads_in_flight:
                self.tiers.wait_for_loads(LOAD_WAIT_SECONDS)  # nothing to run but loads
            return []
        outputs = self.run_plan(plan)
        if self.speculator is not None:
            self.speculator.observe_step(plan, time.perf_counter() - t0)
        return outputs

    def run_plan(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """The rest of :meth:`step` after scheduling: execute ``plan`` (from
        ``scheduler.schedule()``), sample, and return the requests it touched."""
        times = self.step_times
        ending, logits = self.execute_plan(plan)
        t1 = time.perf_counter()
        drafts = {i.seq.seq_id: i.draft_token_ids for i in plan.scheduled if i.draft_token_ids}
        if drafts:
            outputs = self._sample_with_drafts(ending, logits, drafts)
            t2 = time.perf_counter()  # verifying and recording, counted as sampling
        else:
            sampling, logits = self._fork_parallel_samples(ending, logits)
            sampled, failures = sample_isolated(self.sampler, sampling, logits, self.stop_token_ids)
            t2 = time.perf_counter()
            outputs = self._process(sampling, sampled, failures)
        times.sample += t2 - t1
        if self.speculator is not None:
            self._offer_guesses()
        times.postprocess += time.perf_counter() - t2
        times.steps += 1
        self.counters.last_batched_tokens = plan.num_batched_tokens
        self.counters.max_concurrent_seqs = max(
            self.counters.max_concurrent_seqs, len(plan.scheduled)
        )
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
        copies = BlockCopies(
            plan.swap_out,
            plan.swap_in,
            plan.block_copies,
            plan.block_encodes,
            plan.tier_moves,
            plan.read_ahead,
        )
        batch = self.runner.build_batch(plan)
        t1 = time.perf_counter()
        executor = self.executor
        with executor.guard() if executor else nullcontext():
            if executor is not None:
                executor.send_step(StepWork.of(copies, batch))
            if self.drafter is not None:
                self.drafter.apply(copies)
            output = self.worker.execute(copies, batch)
            if batch.prompt_spans:
                self._record_prompt_logprobs(batch.prompt_spans, output.prompt_hidden)
        times.prepare += t1 - t0
        seconds = time.perf_counter() - t1
        times.forward += seconds
        if self.tiers is not None and plan.num_batched_tokens >= PREFILL_RATE_MIN_TOKENS:
            self.tiers.note_prefill(plan.num_batched_tokens, seconds)
        return self.scheduler.update_from_output(plan), output.logits

    def _sample_with_drafts(
        self,
        ending: list[TokenSequence],
        logits: torch.Tensor,
        drafts: dict[int, list[int]],
    ) -> list[RequestOutput]:
        """Sample the plain rows, verify the guessing sequences' rows, record both, then
        settle each guessing sequence (commit the kept guesses, roll back the rest).
        Sequences that guess only decode, so none of them forks here."""
        split = StepRows.split(ending, drafts)
        plain, plain_logits = self._fork_parallel_samples(split.plain, logits[split.plain_rows])
        sampled, failures = sample_isolated(self.sampler, plain, plain_logits, self.stop_token_ids)
        verified, verify_failures = verify_isolated(
            split.guessing,
            split.guesses,
            logits[split.guessing_rows],
            self.stop_token_ids,
            [self.speculator.draft_probs.get(seq.seq_id) for seq in split.guessing],
        )
        failures.update(verify_failures)
        rows, merged = merged_rows(plain, sampled, split.guessing, verified)
        outputs = self._process(rows, merged, failures)
        self.speculator.settle(self.scheduler, split, verified)
        return outputs

    def _offer_guesses(self) -> None:
        """Let the speculator offer guesses for the next step, each sequence's within
        its ``max_tokens``."""
        self.speculator.offer(
            self.scheduler.running,
            lambda seq: self._requests[seq.request_id].sequences[seq.index].max_tokens,
            self.config.max_num_batched_tokens,
            prompts_waiting=bool(self.scheduler.waiting),
        )

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
            if seq.request_id in failures or seq.is_finished:
                continue  # a finished sequence's later rows: guesses after its stop
            state = self._requests[seq.request_id]
            out = state.sequences[seq.index]
            logprobs = sampled.logprobs[row] if sampled.logprobs is not None else None
            try:
                status = out.add_token(sampled.token_ids[row], logprobs)
            except Exception as error:
                failures[seq.request_id] = error
                touched.pop(seq.request_id, None)
                continue
            self.counters.generation_tokens_total += 1
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
                # vLLM's prompt_tokens_total: each request's whole prompt, once, when
                # its first token comes (cached tokens count, recomputed ones do not)
                self.counters.prompt_tokens_total += len(state.prompt_token_ids)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if status is not None:
                self.scheduler.finish(seq, status)
                seq.finished_time = now
                if self.speculator is not None:
                    self.speculator.finished(seq, completed=True)
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
        return gather_stats(
            self.scheduler,
            self.counters,
            self.step_times,
            self.swap_space.stats() if self.swap_space is not None else None,
            self.speculator.stats.copy() if self.speculator is not None else None,
        )
