"""Gemma 3's image prompts in the front end (the "framed" layout): the chat template's
``<start_of_image>`` becomes ``"\\n\\n" <start_of_image> <image_soft_token> x N
<end_of_image> "\\n\\n"``, and the newlines it joins are tokenized again, so the ids equal
transformers' ``Gemma3Processor``'s for the same text. The folder: a tiny Gemma 3 config,
a 32 x 32 image processor and a word-level tokenizer that, as Gemma's, has one token for
each run of up to ``MAX_NEWLINES`` newlines."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from vllm.config import ModelConfig
from vllm.exceptions import VLLMValidationError
from vllm.model_executor.models.gemma import Gemma3ForConditionalGeneration
from vllm.multimodal.processing import ImageInputProcessor

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
MAX_NEWLINES = 8  # Gemma's: 31
WORDS = ["<unk>", " ", "user", "look", "at", "and", "x"]
TOKENS_PER_IMAGE = 4
IMAGES = [(40, 20), (24, 48), (32, 32)]  # (width, height)


def save_tokenizer(path) -> transformers.PreTrainedTokenizerBase:
    """Words, spaces and newline runs (a longer run split after ``MAX_NEWLINES``), the
    frame's tokens special; Gemma3Processor reads them as ``boi_token`` and the like."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(WORDS)}
    vocab.update({"\n" * n: len(WORDS) + n - 1 for n in range(1, MAX_NEWLINES + 1)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    split = Regex(rf"\n{{1,{MAX_NEWLINES}}}| |[^\n ]+")
    tok.pre_tokenizer = pre_tokenizers.Split(split, behavior="isolated")
    tok.decoder = decoders.Fuse()
    special = {"boi_token": BOI, "eoi_token": EOI, "image_token": SOFT}
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", extra_special_tokens=special
    ).save_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """(the model folder, its tokenizer, transformers' Gemma3Processor)."""
    path = tmp_path_factory.mktemp("gemma3")
    tokenizer = save_tokenizer(path)
    text = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    vision = transformers.SiglipVisionConfig(
        image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2,
    )  # fmt: skip
    ids = tokenizer.convert_tokens_to_ids
    transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE,
        boi_token_index=ids(BOI), eoi_token_index=ids(EOI), image_token_index=ids(SOFT),
    ).save_pretrained(path)  # fmt: skip
    transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(path)
    image_processor = transformers.AutoImageProcessor.from_pretrained(path, backend="pil")
    reference = transformers.Gemma3Processor(
        image_processor, tokenizer, image_seq_length=TOKENS_PER_IMAGE
    )
    return path, tokenizer, reference


def ours(path, tokenizer, **fields) -> ImageInputProcessor:
    config = ModelConfig(model=str(path), **fields)
    return ImageInputProcessor(config, tokenizer, Gemma3ForConditionalGeneration)


def images(n: int) -> list[Image.Image]:
    rng = np.random.RandomState(0)
    return [Image.fromarray(rng.randint(0, 255, (h, w, 3), dtype=np.uint8)) for w, h in IMAGES[:n]]


@pytest.mark.parametrize(
    "text",
    [
        f"user\n{BOI}look",  # "\n" + "\n\n": one "\n\n\n"
        f"user\n\n{BOI}look",
        f"{BOI}look at",  # at the start
        f"look{BOI}\nx",  # before "\n"
        f"look{BOI}x",
        f"look\n\n\n\n\n\n\n{BOI}\n\n\nx",  # 9 and 5 newlines: a run past the longest token
        f"user\n{BOI} and\n{BOI}\n\n",  # two images
        f"user\n{BOI}{BOI}{BOI}x",  # back to back: "\n\n" + "\n\n" between them
    ],
)
def test_ids_pixels_and_offsets_equal_gemma3_processor(folder, text):
    path, tokenizer, reference = folder
    n = text.count(BOI)
    expected = reference(text=text, images=images(n), return_tensors="pt")
    prompt = tokenizer.encode(text, add_special_tokens=False)
    ids, features = ours(path, tokenizer).process(prompt, images(n))
    assert ids == expected["input_ids"][0].tolist()
    boi, eoi, soft = tokenizer.convert_tokens_to_ids([BOI, EOI, SOFT])
    assert len(features) == n
    for i, f in enumerate(features):
        assert ids[f.offset - 1] == boi and ids[f.end] == eoi  # the frame is text
        assert ids[f.offset : f.end] == [soft] * TOKENS_PER_IMAGE
        assert f.is_embed is None and f.length == TOKENS_PER_IMAGE
        assert torch.equal(f.data, expected["pixel_values"][i : i + 1].float())
    assert len({f.identifier for f in features}) == n


def test_newlines_merge_only_with_the_frames_own(folder):
    """The run a frame's "\\n\\n" joins stops at a word; newlines elsewhere stay as given,
    even unmerged ones."""
    path, tokenizer, _ = folder
    nl = {n: tokenizer.convert_tokens_to_ids("\n" * n) for n in (1, 2, 3)}
    x, boi, eoi, soft = tokenizer.convert_tokens_to_ids(["x", BOI, EOI, SOFT])
    prompt = [nl[1], nl[1], x, nl[1], boi, nl[1], x, nl[1], nl[1]]
    ids, [feature] = ours(path, tokenizer).process(prompt, images(1))
    image = [boi, *[soft] * TOKENS_PER_IMAGE, eoi]
    assert ids == [nl[1], nl[1], x, nl[3], *image, nl[3], x, nl[1], nl[1]]
    assert feature.offset == 5  # the run before it lost a token


def test_pan_and_scan_is_refused(folder, tmp_path):
    """From the server's arguments (at start), a request's, or the folder's config (a
    request may turn it off)."""
    path, tokenizer, _ = folder
    with pytest.raises(VLLMValidationError, match="do_pan_and_scan") as e:
        ours(path, tokenizer, mm_processor_kwargs={"do_pan_and_scan": True})
    assert e.value.param == "mm_processor_kwargs"
    processor = ours(path, tokenizer)
    with pytest.raises(VLLMValidationError, match="do_pan_and_scan") as e:
        processor.request_kwargs({"do_pan_and_scan": True})
    assert e.value.param == "mm_processor_kwargs"
    prompt = tokenizer.encode(f"look{BOI}", add_special_tokens=False)
    off = processor.request_kwargs({"do_pan_and_scan": False})
    assert processor.process(prompt, images(1), off)[1][0].data.shape == (1, 3, 32, 32)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / name, tmp_path / name)
    config = json.loads((path / "preprocessor_config.json").read_text())
    config.update(  # pans the 40 x 20 image into 2 crops more
        do_pan_and_scan=True, pan_and_scan_min_crop_size=8, pan_and_scan_max_num_crops=4,
        pan_and_scan_min_ratio_to_activate=1.2,
    )  # fmt: skip
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    panned = ours(tmp_path, tokenizer)
    with pytest.raises(VLLMValidationError, match="preprocessor_config.json sets it") as e:
        panned.process(prompt, images(1))
    assert e.value.param == "mm_processor_kwargs"
    ids, [feature] = panned.process(prompt, images(1), panned.request_kwargs(off))
    assert feature.data.shape == (1, 3, 32, 32)  # no crops


def test_skip_tokenizer_init_refuses_images(folder):
    path, tokenizer, _ = folder
    processor = ours(path, None)
    assert processor.placeholder is None
    boi = tokenizer.convert_tokens_to_ids(BOI)
    with pytest.raises(VLLMValidationError, match="--skip-tokenizer-init") as e:
        processor.process([boi], images(1))
    assert e.value.param == "multi_modal_data"


def test_the_placeholder_is_the_frames_start(folder):
    """A chat template's image text and the token counted against the images: the boi
    token, not the image token (which transformers' text never holds)."""
    path, tokenizer, _ = folder
    processor = ours(path, tokenizer)
    assert processor.placeholder == BOI
    soft, boi = tokenizer.convert_tokens_to_ids([SOFT, BOI])
    with pytest.raises(VLLMValidationError, match=f"'{BOI}'.* it holds 0") as e:
        processor.process([soft], images(1))
    assert e.value.param == "multi_modal_data"
    with pytest.raises(VLLMValidationError, match="2 images need 2") as e:
        processor.process([boi], images(2))
    assert e.value.param == "multi_modal_data"
