"""``attnpatch eval generate``: greedy generations patched against unpatched (token agreement, first divergence,
exact match, time to first token, decode speed), on a tiny Llama and a tiny LLaVA with an image."""

from __future__ import annotations

import pytest
import torch

from attnpatch.errors import OptionError
from attnpatch.evals.generate import GenerationInput, agreement, run_generate
from tiny_models import tiny_causal_lm, tiny_vlm


def test_agreement_counts_positions_first_divergence_and_exact_match():
    assert agreement([1, 2, 3, 4], [1, 2, 3, 4]) == {"token_agreement": 1.0, "first_divergence": None, "exact_match": True}
    assert agreement([1, 2, 3, 4], [1, 9, 3, 4]) == {"token_agreement": 0.75, "first_divergence": 1, "exact_match": False}
    assert agreement([1, 2, 3, 4], [1, 2]) == {"token_agreement": 0.5, "first_divergence": 2, "exact_match": False}
    assert agreement([1, 2], [1, 2, 5]) == {"token_agreement": 1.0, "first_divergence": 2, "exact_match": False}
    assert agreement([], []) == {"token_agreement": 1.0, "first_divergence": None, "exact_match": True}


def _ids(n, seed):
    ids = torch.randint(3, 120, (1, n), generator=torch.Generator().manual_seed(seed))
    return GenerationInput(f"random {seed}", {"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def test_a_tiny_llama_at_the_exact_limit_generates_what_dense_does_and_an_approximation_is_measured():
    model = tiny_causal_lm("llama", layers=2)
    inputs = [_ids(64, 0), _ids(80, 1)]
    small = dict(block_size=16, init_block=16, local_window=16, min_len=0, dense_last=0, min_recall=0.0, pool_stride=None,
                 select_dtype="float32")
    res = run_generate(model, inputs, settings=[("anchor_attention", {**small, "theta": float("inf")}),
                                                ("anchor_attention", {**small, "theta": -1e9})],
                       max_new_tokens=8, pad_token_id=0)
    exact, sparse = res["runs"]
    assert exact["token_agreement"] == 1.0 and exact["exact_match"] == 1.0 and exact["first_divergence"] == [None, None]
    assert "dense:theta=inf" in exact["modes"]
    assert 0.0 <= sparse["token_agreement"] <= 1.0 and sparse["modes"] and "dense:theta=inf" not in sparse["modes"]
    assert res["prompt_tokens"] == [64, 80] and res["dense"]["ttft_s_median"] > 0
    for row in res["per_input"]:
        assert len(row["dense"]["tokens"]) == 8 and row["dense"]["ttft_s"] <= row["dense"]["seconds"]
    with pytest.raises(OptionError, match="max_new_tokens=0"):
        run_generate(model, inputs, settings=[], max_new_tokens=0)


def test_a_tiny_llava_generates_from_an_image_with_its_vision_tower_patched():
    model = tiny_vlm("llava")
    n_img = 16  # 32 px at patch 8, CLS dropped by LLaVA's default feature select
    ids = torch.tensor([[1] + [255] * n_img + list(range(10, 30))])
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    item = GenerationInput("image 0", {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels})
    res = run_generate(model, [item], settings=[("fna", {"s": 17, "min_tokens": 0}), ("fna", {"s": 4, "min_tokens": 0,
                                                                                       "sample_layer": 0})],
                       towers="vision", max_new_tokens=6, pad_token_id=0)
    exact, approx = res["runs"]
    assert exact["exact_match"] == 1.0 and exact["token_agreement"] == 1.0  # s >= N: the vision tower is exact
    assert approx["modes"] and all(m == "fna" or m.startswith("dense:") for m in approx["modes"])
    assert len(res["per_input"][0]["dense"]["tokens"]) == 6


def test_eval_generate_cli_on_prompt_files(tiny_lm_dir, tmp_path, capsys):
    import json

    from attnpatch.cli import main

    prompts = tmp_path / "prompts"
    prompts.mkdir()
    (prompts / "a.txt").write_text("the quick brown fox jumps over the lazy dog " * 8)
    (prompts / "b.txt").write_text("one two three four five six seven eight nine ten " * 6)
    out, md = tmp_path / "g.json", tmp_path / "g.md"
    rc = main(["eval", "generate", "--model", str(tiny_lm_dir), "--prompts", str(prompts), "--max-new-tokens", "5",
               "--method", "dense", "anchor_attention:theta=inf", "--json", str(out), "--markdown", str(md)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert [r["method"] for r in res["runs"]] == ["dense", "anchor_attention"]
    assert all(r["token_agreement"] == 1.0 and r["exact_match"] == 1.0 for r in res["runs"])
    assert res["n_inputs"] == 2 and len(res["per_input"][0]["dense"]["tokens"]) <= 5
    printed = capsys.readouterr().out
    assert "TTFT" in printed and "token agreement" in md.read_text() and md.read_text().count("\n|") >= 3
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    rc = main(["eval", "generate", "--model", str(tiny_lm_dir), "--method", "fna"])
    assert rc != 0


def _tiny_llava_folder(tmp_path):
    """A tiny random LLaVA saved with a processor built here (a word-level tokenizer whose ``<image>`` is id 255, a
    32 px CLIP image processor): what ``load_vlm`` reads, without any hub."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 255)}, "<image>": 255}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>", extra_special_tokens={"image_token": "<image>"})
    fast.add_special_tokens({"additional_special_tokens": ["<image>"]})
    assert fast.convert_tokens_to_ids("<image>") == 255
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(image_processor=images, tokenizer=fast, patch_size=8, vision_feature_select_strategy="default",
                               image_token="<image>", num_additional_image_tokens=1)
    folder = tmp_path / "tiny-llava"
    tiny_vlm("llava").save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def test_eval_generate_cli_on_a_vlm_with_one_method_per_tower(tmp_path, capsys):
    import json

    import numpy as np
    from PIL import Image

    from attnpatch.cli import main

    folder = _tiny_llava_folder(tmp_path)
    data = tmp_path / "images" / "any"
    data.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(2):
        Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(data / f"{i}.png")
    out = tmp_path / "gen.json"
    vision = "vision=fna:s=4,sample_layer=0,min_tokens=0"
    text = "text=anchor_attention:block_size=16,init_block=16,local_window=16,min_len=0,theta=-1e9"
    rc = main(["eval", "generate", "--model", str(folder), "--images", str(tmp_path / "images"), "--samples", "2",
               "--max-new-tokens", "3", "--method", vision, f"{vision}+{text}", "--json", str(out),
               "--markdown", str(tmp_path / "gen.md")])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["n_inputs"] == 2 and all(t > 16 for t in res["prompt_tokens"])  # 16 image tokens + the question
    only_vision, both = res["runs"]
    assert only_vision["per_tower"] == {"vision": "fna"} and both["per_tower"] == {"vision": "fna", "text": "anchor_attention"}
    assert "fna" in only_vision["modes"] and {"fna", "sparse"} <= set(both["modes"])
    table = (tmp_path / "gen.md").read_text()
    assert "| vision=fna (s=4, sample_layer=0, min_tokens=0) + text=anchor_attention (block_size=16, " in table


def test_eval_generate_cli_refuses_a_bad_tower_setting_before_loading(tmp_path, capsys):
    from attnpatch.cli import main

    for bad, words in [("eyes=fna", "'eyes' is not a tower; a VLM's towers are vision, text"),
                       ("vision=anchor_attention", "--method vision=anchor_attention: method 'anchor_attention' does not fit the vision tower"),
                       ("vision=fna+vision=nystromformer", "the vision tower is given twice")]:
        rc = main(["eval", "generate", "--model", str(tmp_path / "none"), "--images", str(tmp_path), "--method", bad])
        assert rc != 0 and words in capsys.readouterr().err, bad
