"""The offline API in vLLM's shape: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from tqdm import tqdm

from pagedllm.config import EngineConfig
from pagedllm.engine.beam_search import BeamSearchOutput, BeamSearchParams
from pagedllm.engine.beam_search_runner import BeamSearchRunner
from pagedllm.engine.llm_engine import LLMEngine, PromptInput
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.tokenizer import Tokenizer

Message = Mapping[str, str]


class LLM:
    """Batch generation over the paged engine; every keyword is an :class:`EngineConfig`
    field (``model``, ``dtype``, ``block_size``, ``kv_cache_memory``, ``max_num_seqs``,
    ``max_model_len``, ``max_num_batched_tokens``, ...)."""

    def __init__(self, model: str | None = None, **kwargs: object) -> None:
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._next_id = 0

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an engine built elsewhere (e.g. sharing an already loaded model)."""
        llm = cls.__new__(cls)
        llm.llm_engine = engine
        llm._next_id = 0
        return llm

    def get_tokenizer(self) -> Tokenizer:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        ``prompts``: a string, a ``{"prompt_token_ids": [...]}`` dict, or a list of them.
        ``sampling_params``: one for all prompts or one per prompt (default: vLLM's
        defaults, 16 tokens at temperature 1).
        """
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(priorities)} priorities for {len(prompts)} prompts")
        return self._run(prompts, params, priorities, use_tqdm)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered with the
        model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        tokenizer = self.get_tokenizer()
        prompts = [
            {
                "prompt_token_ids": tokenizer.apply_chat_template(
                    [dict(m) for m in conversation], add_generation_prompt=add_generation_prompt
                )
            }
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt (vLLM's ``LLM.beam_search``); outputs in prompt
        order, each with ``params.beam_width`` sequences best first.

        Runs alone on the engine; beams share KV blocks (see
        :mod:`pagedllm.engine.beam_search` for the rule, transformers' ``num_beams``).
        """
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        runner = BeamSearchRunner(self.llm_engine)
        for prompt in prompts:
            text, token_ids = self.llm_engine.tokenize_prompt(prompt)
            runner.add(token_ids, params, text)
        results: list[BeamSearchOutput | None] = [None] * len(prompts)
        with tqdm(total=len(prompts), desc="Beam search", disable=not use_tqdm) as bar:
            while runner.has_unfinished:
                for key, output in runner.step():
                    results[key] = output
                    bar.update(1)
        return results

    @staticmethod
    def _params_per_prompt(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * num_prompts
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        params = list(sampling_params)
        if len(params) != num_prompts:
            raise ValueError(f"{len(params)} sampling params for {num_prompts} prompts")
        return params

    def _run(
        self,
        prompts: list[PromptInput],
        params: list[SamplingParams],
        priorities: list[int],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        order: dict[str, int] = {}
        # only the final outputs are kept: one copy per distinct params object
        final_only = {
            id(p): dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params
        }
        params = [final_only[id(p)] for p in params]
        for index, (prompt, p, priority) in enumerate(
            zip(prompts, params, priorities, strict=True)
        ):
            request_id = f"llm-{self._next_id}"
            self._next_id += 1
            try:
                p.check_for_model(engine.model_config.vocab_size, engine.tokenizer)
                engine.add_request(request_id, prompt, p, priority=priority)
            except ValueError:
                for queued in order:
                    engine.abort_request(queued)
                raise
            order[request_id] = index
        results: list[RequestOutput | None] = [None] * len(prompts)
        with tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm) as bar:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished and output.request_id in order:
                        results[order[output.request_id]] = output
                        bar.update(1)
        return results
