"""GGUF files of the newer architectures, written the way llama.cpp's converter writes
them (its tensor names; Q/K rows in Hugging Face order for the NeoX-rope Qwen models),
against transformers on the same weights; and the architectures whose llama.cpp layout
is not implemented are refused by name."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from test_models_gguf import TOKENS, logits_of, write_gguf
from transformers_oracle import LOGITS_TOLERANCE, write_random_checkpoint

from pagedllm.models import ModelLoadError, load_model


def test_qwen3_gguf_with_qk_norms_matches_transformers(tmp_path):
    hf_model = write_random_checkpoint(tmp_path / "hf", "qwen3", head_dim=16)
    loaded = load_model(write_gguf(tmp_path / "q.gguf", hf_model, arch="qwen3"))
    assert loaded.config.architecture == "qwen3"
    with torch.no_grad():
        expected = hf_model(torch.tensor([TOKENS])).logits[0]
    torch.testing.assert_close(logits_of(loaded.model), expected, atol=LOGITS_TOLERANCE, rtol=0)


@pytest.mark.parametrize("arch", ["gemma2", "phi3", "olmo2"])
def test_other_gguf_architectures_are_refused_by_name(tmp_path, arch):
    writer = gguf.GGUFWriter(tmp_path / "x.gguf", arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=f"unsupported GGUF architecture '{arch}'"):
        load_model(tmp_path / "x.gguf")
