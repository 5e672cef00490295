"""``pagedllm plan``: how much KV cache a model needs and how many sequences a memory holds.

- :mod:`~pagedllm.models.presets`: a few popular model shapes, stored as data;
- :mod:`~pagedllm.plan.model_shape`: the facts the planner needs, from any source;
- :mod:`~pagedllm.plan.capacity`: the arithmetic (bytes per token, blocks, sequences);
- :mod:`~pagedllm.plan.report`: the text table and the JSON document;
- :mod:`~pagedllm.plan.plot`: contiguous against paged layout as a picture.
"""
