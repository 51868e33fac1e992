"""Images -> what the engine carries (``MultiModalFeature``), in the front end.

Each image goes through the model's own image processor (transformers'
``AutoImageProcessor`` from the model folder: resize, crop, normalise) into pixel values.
The prompt names each image with one placeholder token (LLaVA's ``<image>``, Gemma 3's
``<start_of_image>``), in the images' order; each placeholder becomes as many placeholder
tokens as the model makes embeddings of an image (with the markers around them that the
model's transformers processor writes), as vLLM's prompt replacement does, so the
prompt's length is what the model computes and what the KV cache holds.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
from dataclasses import replace
from typing import Any

import torch

from vllm.exceptions import VLLMValidationError
from vllm.multimodal.inputs import MultiModalFeature

logger = logging.getLogger(__name__)

# vLLM v1's limit per modality when --limit-mm-per-prompt names none.
DEFAULT_LIMIT_PER_PROMPT = 999
MODALITIES = ("image",)
PARAM = "multi_modal_data"
KWARGS = "mm_processor_kwargs"
# The image processor's arguments that fix what the model was built for (its patch and
# merge sizes, its tokens per image) or the tensors' form: neither a request nor the
# server may set them.
FIXED_KWARGS = frozenset({
    "patch_size", "temporal_patch_size", "merge_size", "image_seq_length", "return_tensors",
    "data_format", "input_data_format", "device", "return_row_col_info", "images",
    "pooling_kernel_size",
})  # fmt: skip
# The arguments that size an image. A request may lower them, never raise them above the
# server's (an image sized up to billions of pixels would exhaust the front end's memory).
# InternVL's max_patches bounds an image's tiles, so its tokens, alike; Gemma 4's
# max_soft_tokens its tokens.
SIZE_KWARGS = frozenset({
    "size", "min_pixels", "max_pixels", "max_image_size", "crop_size", "max_patches",
    "max_soft_tokens",
})  # fmt: skip
# Gemma 3's pan-and-scan adds crops of an image, each with another prompt text.
_PAN_AND_SCAN = f"{KWARGS}: do_pan_and_scan is not supported (Gemma 3's pan-and-scan crops)"
# The newline runs whose ids are kept (a frame's own and what the text adds to it).
_CACHED_NEWLINES = 64
# transformers keeps Qwen-VL's min/max_pixels in ``size``, as these edges.
_SIZE_ALIASES = {"min_pixels": "shortest_edge", "max_pixels": "longest_edge"}


def image_model_class(model_config) -> type | None:
    """The model class of ``model_config`` when it takes images, else None (read from the
    folder's config.json and the registry: no weights, no full config load)."""
    from vllm.model_executor.model_loader import _config_json, resolve_model
    from vllm.model_executor.models.registry import ModelRegistry

    path = resolve_model(
        model_config.model, model_config.revision, model_config.download_dir,
        model_config.hf_token,
    )  # fmt: skip
    config = _config_json(path)
    for arch in config.get("architectures") or ():
        if arch in ModelRegistry.models:
            cls = ModelRegistry._load(arch)
            takes = getattr(cls, "takes_images", None)  # per checkpoint (Qwen-VL's)
            images = takes(config) if takes is not None else getattr(cls, "supports_images", False)
            return cls if images else None
    return None


class ImageInputProcessor:
    """A model's image inputs: ``process(prompt_ids, images)`` -> (the prompt with its
    placeholders expanded, one ``MultiModalFeature`` per image).

    Seven prompt layouts, as the model class says (``image_layout``):

    - whole (LLaVA): an image is one tile, its placeholder ``tokens_per_image`` image
      tokens;
    - tiled (Idefics3, SmolVLM): the image processor cuts an image into R x C tiles and
      adds the whole image as a last tile; the placeholder becomes transformers'
      prompt string for them, each tile's ``<fake_token_around_image><row_r_col_c>`` then
      its image tokens, a newline after each row, and the global tile between
      ``<fake_token_around_image><global-img>`` and ``<fake_token_around_image>``;
      only the image tokens take embeddings (``is_embed``);
    - grid (Qwen2-VL, Qwen2.5-VL): the image processor sizes an image to a grid of patches
      (t, h, w); its placeholder becomes t * h * w / merge**2 image tokens, whose M-RoPE
      positions follow the merged grid (``mrope_grid``);
    - rows (Mistral 3's Pixtral): the image processor resizes an image to R x C squares of
      the merged patch (``patch_size * spatial_merge_size`` pixels), the encoder takes it
      at that size, unpadded; its placeholder becomes, per row, C image tokens
      (``[IMG]``) then ``[IMG_BREAK]``, the last row's break ``[IMG_END]``
      (transformers' ``PixtralProcessor``); only the image tokens take embeddings;
    - framed (Gemma 3): the prompt names an image with the frame's start token
      (``<start_of_image>``, what the chat template writes); it becomes ``"\\n\\n"``, the
      start token, ``tokens_per_image`` image tokens, the end token, ``"\\n\\n"``
      (transformers' ``Gemma3Processor``), the image one (1, 3, H, W) tile; each run of
      newline tokens those ``"\\n\\n"`` join is encoded again as that many newlines, as
      tokenizing the expanded text would (``_join_newlines``). The feature is the image
      tokens alone: the frame is text;
    - framed_tiles (InternVL): the prompt names an image with one image token
      (``<IMG_CONTEXT>``, what the chat template writes); the image processor cuts it
      into tiles (``crop_to_patches``, as ``InternVLProcessor`` asks: a grid and, past one
      tile, the whole image as a last one) and the token becomes ``<img>``,
      ``tokens_per_tile`` image tokens per tile, ``</img>`` (special tokens: the text
      around them tokenizes as it came). The feature is the image tokens, its data the
      (tiles, 3, H, W) tiles; the frame's ids are the tokenizer's;
    - framed_patches (Gemma 4): the prompt names an image with its image token
      (``<|image|>``); the image processor resizes it, keeping its aspect ratio, to H x W
      patches and flattens them; the token becomes the start token, one image token per
      pooled patch (the feature), the end token (transformers' ``Gemma4Processor``:
      special tokens, ids from the config). The feature's data is the image's patches
      without the processor's padding, (H * W, patch values), its ``grid_thw`` (1, H, W).
    """

    def __init__(self, model_config, tokenizer, model_cls: type) -> None:
        from vllm.model_executor.model_loader import hf_config_of, resolve_model

        self.path = resolve_model(
            model_config.model, model_config.revision, model_config.download_dir,
            model_config.hf_token,
        )  # fmt: skip
        hf_config = hf_config_of(model_config)
        # "whole" (LLaVA), "tiled" (SmolVLM, Idefics3), "grid" (Qwen2-VL), "rows"
        # (Mistral 3), "framed" (Gemma 3), "framed_tiles" (InternVL) or "framed_patches"
        # (Gemma 4): class docstring.
        self.layout = getattr(model_cls, "image_layout", "whole")
        module = importlib.import_module(model_cls.__module__)
        if self.layout == "grid":
            self.image_token_id, self.merge = module.qwen_vl_image_layout(hf_config)
            self.tokens_per_tile = 0  # each image's own: its grid's
        elif self.layout == "rows":
            self.rows = module.image_rows_layout(hf_config)  # its tokens and merged patch
            self.image_token_id, self.tokens_per_tile = self.rows.image_token_id, 0
            self._row_end_ids: tuple[int, int] | None = None  # (break, end): the first image's
        elif self.layout == "framed":
            self.frame = module.image_frame_layout(hf_config)
            self.image_token_id = self.frame.image_token_id
            self.tokens_per_tile = self.frame.tokens_per_image
            self._newline_counts: dict[int, int] = {}  # token id -> its newlines (0: other)
            self._newline_ids: dict[int, list[int]] = {}  # n -> the ids of n newlines
        elif self.layout == "framed_patches":
            self.frame = module.image_frame_layout(hf_config)
            self.image_token_id, self.tokens_per_tile = self.frame.image_token_id, 0
        elif self.layout == "framed_tiles":
            self.context = module.image_context_layout(hf_config)
            self.image_token_id = self.context.image_token_id
            self.tokens_per_tile = self.context.tokens_per_tile
            self._frame_ids: tuple[int, int] | None = None  # (start, end): the first image's
        else:
            self.image_token_id, self.tokens_per_tile = module.image_token_layout(hf_config)
        # The token that names an image in the prompt (Gemma 3's: its frame's start).
        framed = self.layout == "framed"
        self.placeholder_id = self.frame.boi_token_id if framed else self.image_token_id
        limits = model_config.limit_mm_per_prompt or {}
        self.limit = limits.get("image", DEFAULT_LIMIT_PER_PROMPT)
        self.tokenizer = tokenizer
        # The text that stands for one image in a prompt (a chat template's placeholder).
        self.placeholder: str | None = None
        if tokenizer is not None:
            self.placeholder = tokenizer.convert_ids_to_tokens(self.placeholder_id)
        self._image_processor = None  # loaded by the first image
        # A model module's own image processor where transformers' cannot run here (Kimi
        # K2.5's needs torchvision): ``make_image_processor(folder)``.
        make = getattr(module, "make_image_processor", None)
        if make is not None:
            self._image_processor = make(self.path)
        self._tile_prompts: dict[tuple[int, int], list[int]] = {}  # (R, C) -> its ids
        # What a whole image or a tile must measure (H, W): the vision tower's input.
        vision = getattr(hf_config, "vision_config", None)
        size = getattr(vision, "image_size", None)
        size = (size, size) if isinstance(size, int) else size  # InternVL's: (h, w)
        self.tile_size = tuple(size) if isinstance(size, (list, tuple)) else None
        # --mm-processor-kwargs: every image's arguments (a request's own go over them).
        self.kwargs: dict[str, Any] = {}
        if model_config.mm_processor_kwargs:
            self.kwargs = self._checked(model_config.mm_processor_kwargs)

    @classmethod
    def for_model(cls, model_config, tokenizer) -> ImageInputProcessor | None:
        """The processor of a model that takes images; None for a text-only model."""
        model_cls = image_model_class(model_config)
        return None if model_cls is None else cls(model_config, tokenizer, model_cls)

    @property
    def image_processor(self):
        if self._image_processor is None:
            from transformers import AutoImageProcessor

            try:
                # The PIL backend: the same pixels whether or not torchvision is installed.
                self._image_processor = AutoImageProcessor.from_pretrained(self.path, backend="pil")
            except (OSError, ValueError) as e:
                raise VLLMValidationError(
                    f"the model folder {self.path} has no image processor config "
                    f"(preprocessor_config.json): {e}",
                    PARAM,
                ) from e
        return self._image_processor

    def _checked(self, kwargs: Any) -> dict[str, Any]:
        """``kwargs`` when each is an argument of the model's image processor that may be
        set (not in ``FIXED_KWARGS``); ``VLLMValidationError`` naming mm_processor_kwargs."""
        if not isinstance(kwargs, dict):
            raise VLLMValidationError(
                f"{KWARGS} must be an object, got {type(kwargs).__name__}", KWARGS
            )
        processor = self.image_processor
        valid = getattr(getattr(processor, "valid_kwargs", None), "__annotations__", {})
        for key in kwargs:
            if key in FIXED_KWARGS:
                raise VLLMValidationError(
                    f"{KWARGS}: {key!r} cannot be set: the model is built for its own", KWARGS
                )
            if key not in valid:
                takes = ", ".join(sorted(set(valid) - FIXED_KWARGS))
                raise VLLMValidationError(
                    f"{KWARGS}: {key!r} is not an argument of this model's image processor "
                    f"({type(processor).__name__}); it takes {takes}",
                    KWARGS,
                )
        if self.layout == "framed" and kwargs.get("do_pan_and_scan"):
            raise VLLMValidationError(_PAN_AND_SCAN, KWARGS)
        return dict(kwargs)

    def request_kwargs(self, kwargs: Any) -> dict[str, Any]:
        """A request's ``mm_processor_kwargs`` over the server's (key by key), checked:
        ``_checked``'s, and sizes (``SIZE_KWARGS``) no larger than the server's."""
        kwargs = self._checked(kwargs)
        for key in SIZE_KWARGS.intersection(kwargs):
            if not _within(kwargs[key], self._server_size(key)):
                raise VLLMValidationError(
                    f"{KWARGS}: {key} {kwargs[key]!r} is larger than the server's "
                    f"{self._server_size(key)!r}: a request may lower an image's size, not "
                    "raise it (the server's --mm-processor-kwargs can)",
                    KWARGS,
                )
        return {**self.kwargs, **kwargs}

    def _server_size(self, key: str) -> Any:
        """The size ``key`` every image gets: the server's --mm-processor-kwargs, else the
        image processor's own (Qwen-VL's pixel bounds are edges of its ``size``)."""
        if key in self.kwargs:
            return self.kwargs[key]
        value = getattr(self.image_processor, key, None)
        if value is None and key in _SIZE_ALIASES:
            size = self._server_size("size")
            value = _size_items(size).get(_SIZE_ALIASES[key]) if size is not None else None
        return value

    def process(
        self, prompt_ids: list[int], images: list[Any], kwargs: dict[str, Any] | None = None
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """``kwargs``: the image processor's arguments (a request's, ``request_kwargs``;
        None: the server's)."""
        kwargs = self.kwargs if kwargs is None else kwargs
        if len(images) > self.limit:
            raise VLLMValidationError(
                f"at most {self.limit} images a prompt (--limit-mm-per-prompt), got {len(images)}",
                PARAM,
            )
        slots = [i for i, t in enumerate(prompt_ids) if t == self.placeholder_id]
        if len(slots) != len(images):
            named = f" ({self.placeholder!r})" if self.placeholder else ""
            raise VLLMValidationError(
                f"{len(images)} images need {len(images)} image placeholder tokens{named} in "
                f"the prompt, one where each image goes, in order; it holds {len(slots)}",
                PARAM,
            )
        if self.layout in ("tiled", "framed", "framed_tiles") and self.tokenizer is None:
            raise VLLMValidationError(
                "this model's image prompts are built with its tokenizer, which "
                "--skip-tokenizer-init leaves out",
                PARAM,
            )
        ids: list[int] = []
        features = []
        last = 0
        for slot, image in zip(slots, images, strict=True):
            ids += prompt_ids[last:slot]
            feature, image_ids = getattr(self, f"_{self.layout}")(image, len(ids), kwargs)
            features.append(feature)
            ids += image_ids
            last = slot + 1
        ids += prompt_ids[last:]
        if self.layout == "framed":
            ids, features = self._join_newlines(ids, features)
        return ids, features

    def _whole(self, image, offset: int, kwargs: dict) -> tuple[MultiModalFeature, list[int]]:
        """The image as one (1, 3, H, W) tile at prompt position ``offset``, and the image
        tokens that stand for it."""
        out = self.image_processor(images=[image], return_tensors="pt", **kwargs)
        pixels = self._sized(out["pixel_values"].float(), kwargs)
        n = self.tokens_per_tile
        return MultiModalFeature("image", pixels, offset, n, content_hash(pixels)), [
            self.image_token_id
        ] * n

    def _framed(self, image, offset: int, kwargs: dict) -> tuple[MultiModalFeature, list[int]]:
        """Gemma 3's: the image as one (1, 3, H, W) tile, without pan-and-scan crops, and
        its frame: ``"\\n\\n"``, the start token, the image tokens (the feature), the end
        token, ``"\\n\\n"``."""
        processor = self.image_processor
        if kwargs.get("do_pan_and_scan", getattr(processor, "do_pan_and_scan", None)):
            raise VLLMValidationError(  # set by the folder's preprocessor_config.json
                f"{_PAN_AND_SCAN}; the model folder's preprocessor_config.json sets it: set "
                f'{KWARGS} {{"do_pan_and_scan": false}}',
                KWARGS,
            )
        # False, not unset: the processor's own default must not turn the crops on.
        out = processor(images=[image], return_tensors="pt", **{**kwargs, "do_pan_and_scan": False})
        pixels = self._sized(out["pixel_values"].float(), kwargs)
        newlines, f, n = self._newlines(2), self.frame, self.tokens_per_tile
        image_ids = [*newlines, f.boi_token_id, *[f.image_token_id] * n, f.eoi_token_id, *newlines]
        start = offset + len(newlines) + 1
        return MultiModalFeature("image", pixels, start, n, content_hash(pixels)), image_ids

    def _join_newlines(
        self, ids: list[int], features: list[MultiModalFeature]
    ) -> tuple[list[int], list[MultiModalFeature]]:
        """``ids`` with each run of newline tokens that holds a frame's ``"\\n\\n"``
        replaced by the tokenizer's ids of that many newlines, and ``features`` shifted to
        match. Gemma's tokenizer has one token for a run of newlines ("\\n" then "\\n\\n":
        one "\\n\\n\\n"), and a special token (the frame's start and end, the chat
        template's) ends a run, so this is what tokenizing the expanded text gives; the
        prompt's other newlines are left as they came."""
        k = len(self._newlines(2))
        starts = sorted({s for f in features for s in (f.offset - 1 - k, f.end + 1)})
        out: list[int] = []
        removed: list[tuple[int, int]] = []  # (where a run ended, tokens it lost)
        pos = 0
        for lo in starts:
            if lo < pos:  # in the run before (images back to back)
                continue
            hi = lo + k
            while lo > pos and self._newline_count(ids[lo - 1]):
                lo -= 1
            while hi < len(ids) and self._newline_count(ids[hi]):
                hi += 1
            run = self._newlines(sum(self._newline_count(t) for t in ids[lo:hi]))
            out += ids[pos:lo] + run
            removed.append((hi, hi - lo - len(run)))
            pos = hi
        out += ids[pos:]
        shifted = [
            replace(f, offset=f.offset - sum(n for end, n in removed if end <= f.offset))
            for f in features
        ]
        return out, shifted

    def _newline_count(self, token_id: int) -> int:
        """The newlines the token is (0: it is not newlines alone)."""
        count = self._newline_counts.get(token_id)
        if count is None:
            text = self.tokenizer.decode([token_id])
            count = len(text) if text and not text.strip("\n") else 0
            self._newline_counts[token_id] = count
        return count

    def _newlines(self, n: int) -> list[int]:
        """The tokenizer's ids of ``n`` newlines; ``VLLMValidationError`` naming
        multi_modal_data when they are not newline tokens alone."""
        ids = self._newline_ids.get(n)
        if ids is None:
            ids = self.tokenizer.encode("\n" * n, add_special_tokens=False)
            counts = [self._newline_count(t) for t in ids]
            if not all(counts) or sum(counts) != n:
                raise VLLMValidationError(
                    "this model's image prompts need its tokenizer to encode newlines as "
                    f"newline tokens; it encodes {n} newlines as {ids}",
                    PARAM,
                )
            if n <= _CACHED_NEWLINES:
                self._newline_ids[n] = ids
        return ids

    def _grid(self, image, offset: int, kwargs: dict) -> tuple[MultiModalFeature, list[int]]:
        """Qwen2-VL's: the image's (patches, patch values) and patch grid (t, h, w), and
        its t * h * w / merge**2 image tokens, whose M-RoPE positions follow the merged
        grid."""
        out = self.image_processor(images=[image], return_tensors="pt", **kwargs)
        patches = out["pixel_values"].float()
        t, h, w = (int(v) for v in out["image_grid_thw"][0])
        m = self.merge
        n = t * h * w // (m * m)
        feature = MultiModalFeature(
            "image", patches, offset, n, content_hash(patches),
            grid_thw=(t, h, w), mrope_grid=(t, h // m, w // m),
        )  # fmt: skip
        return feature, [self.image_token_id] * n

    def _framed_patches(
        self, image, offset: int, kwargs: dict
    ) -> tuple[MultiModalFeature, list[int]]:
        """Gemma 4's: the image's patches (its grid's, row-major, the padding left out) and
        its tokens: the start token, an image token per row the model makes of it, the end
        token."""
        out = self.image_processor(images=[image], return_tensors="pt", **kwargs)
        positions = out["image_position_ids"][0]  # (max_patches, 2): (x, y); -1: padding
        real = (positions != -1).all(dim=-1)
        patches = out["pixel_values"][0][real].float()
        width, height = (int(v) + 1 for v in positions[real].max(dim=0).values)
        n = int(out["num_soft_tokens_per_image"][0])
        f = self.frame
        # The grid joins the hash: equal patches in another grid are another image.
        identifier = hashlib.sha256(f"{content_hash(patches)}|{height}x{width}".encode())
        feature = MultiModalFeature(
            "image", patches, offset + 1, n, identifier.hexdigest(), grid_thw=(1, height, width)
        )
        return feature, [f.boi_token_id, *[f.image_token_id] * n, f.eoi_token_id]

    def _rows(self, image, offset: int, kwargs: dict) -> tuple[MultiModalFeature, list[int]]:
        """Pixtral's: the image's own (1, 3, H, W) pixels, H and W multiples of the merged
        patch, and its tokens: per row of merged patches, as many image tokens then the
        break token, the last row's break the end token; only the image tokens take the
        embeddings (``is_embed``)."""
        brk, end = self._row_ends()
        p = self.rows.patch_pixels
        size = {"height": p, "width": p}  # as PixtralProcessor passes it
        out = self.image_processor(images=[image], return_tensors="pt", patch_size=size, **kwargs)
        height, width = (int(v) for v in out["image_sizes"][0])
        pixels = out["pixel_values"][:, :, :height, :width].float()  # one image: unpadded
        image_ids = ([self.image_token_id] * (width // p) + [brk]) * (height // p)
        image_ids[-1] = end
        mask = [t == self.image_token_id for t in image_ids]
        feature = MultiModalFeature(
            "image", pixels, offset, len(image_ids), content_hash(pixels), mask
        )
        return feature, image_ids

    def _row_ends(self) -> tuple[int, int]:
        """The ids of the "rows" layout's break and end tokens: the config's, else the
        tokenizer's (``_special_id``)."""
        if self._row_end_ids is None:
            self._row_end_ids = (
                self._special_id(self.rows.break_token, self.rows.break_token_id),
                self._special_id(self.rows.end_token, self.rows.end_token_id),
            )
        return self._row_end_ids

    def _special_id(self, token: str, given: int | None = None) -> int:
        """``given`` (the config's id of ``token``), else the tokenizer's id of it;
        ``VLLMValidationError`` naming multi_modal_data where neither has it."""
        if given is not None:
            return given
        if self.tokenizer is None:
            raise VLLMValidationError(
                f"this model's image prompts need the id of {token}, which neither its "
                "config nor a tokenizer gives (--skip-tokenizer-init leaves it out)",
                PARAM,
            )
        found = self.tokenizer.convert_tokens_to_ids(token)
        if found is None or self.tokenizer.convert_ids_to_tokens(found) != token:
            raise VLLMValidationError(
                f"this model's image prompts need {token}, which its tokenizer does not hold",
                PARAM,
            )
        return found

    def _framed_tiles(
        self, image, offset: int, kwargs: dict
    ) -> tuple[MultiModalFeature, list[int]]:
        """InternVL's: the image's (tiles, 3, H, W) tiles, and its tokens: the start token,
        ``tokens_per_tile`` image tokens per tile (the feature), the end token."""
        if self._frame_ids is None:  # the tokenizer's names for them, as the processor's
            c, tok = self.context, self.tokenizer
            start = getattr(tok, "start_image_token", None) or c.start_token
            end = getattr(tok, "end_image_token", None) or c.end_token
            self._frame_ids = (self._special_id(start), self._special_id(end))
        # InternVLProcessor's default, over the image processor's own (off).
        tile_kwargs = {"crop_to_patches": True, **kwargs}
        out = self.image_processor(images=[image], return_tensors="pt", **tile_kwargs)
        tiles = self._sized(out["pixel_values"].float(), kwargs)
        n = tiles.shape[0] * self.tokens_per_tile
        feature = MultiModalFeature("image", tiles, offset + 1, n, content_hash(tiles))
        return feature, [self._frame_ids[0], *[self.image_token_id] * n, self._frame_ids[1]]

    def _tiled(self, image, offset: int, kwargs: dict) -> tuple[MultiModalFeature, list[int]]:
        """(R * C + 1, 3, H, W) tiles, the whole image last (one tile when the processor
        does not split it), and the prompt ids that stand for them: its image tokens take
        the embeddings (``is_embed``), its markers are text."""
        out = self.image_processor(
            images=[image], return_tensors="pt", return_row_col_info=True, **kwargs
        )
        tiles = self._sized(out["pixel_values"][0].float(), kwargs)  # one image: no padding
        rows, cols = out["rows"][0][0], out["cols"][0][0]
        key = (rows, cols)
        if key not in self._tile_prompts:
            self._tile_prompts[key] = self.tokenizer.encode(
                self._tile_text(rows, cols), add_special_tokens=False
            )
        image_ids = self._tile_prompts[key]
        found = sum(t == self.image_token_id for t in image_ids)
        if found != tiles.shape[0] * self.tokens_per_tile:  # the tokenizer lacks a marker
            raise VLLMValidationError(
                f"the image's prompt holds {found} image tokens for {tiles.shape[0]} tiles "
                f"of {self.tokens_per_tile}: the tokenizer does not keep the markers whole",
                PARAM,
            )
        mask = [t == self.image_token_id for t in image_ids]
        feature = MultiModalFeature(
            "image", tiles, offset, len(image_ids), content_hash(tiles), mask
        )
        return feature, image_ids

    def _sized(self, tiles: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """``tiles`` when each measures what the vision tower takes; else (arguments that
        resized them: a crop or tile size of their own) ``VLLMValidationError``."""
        if self.tile_size is not None and tuple(tiles.shape[-2:]) != self.tile_size:
            raise VLLMValidationError(
                f"{KWARGS} {kwargs!r} made images of {tuple(tiles.shape[-2:])} pixels; this "
                f"model's vision tower takes {self.tile_size}",
                KWARGS,
            )
        return tiles

    def _tile_text(self, rows: int, cols: int) -> str:
        """transformers' prompt string for an image of ``rows`` x ``cols`` tiles."""
        fake, image = "<fake_token_around_image>", self.placeholder * self.tokens_per_tile
        whole = f"{fake}<global-img>{image}{fake}"
        if rows == 0 and cols == 0:
            return whole
        text = ""
        for r in range(1, rows + 1):
            text += "".join(f"{fake}<row_{r}_col_{c}>{image}" for c in range(1, cols + 1))
            text += "\n"
        return f"{text}\n{whole}"


def _size_items(value: Any) -> dict[str, Any]:
    """A size argument's fields (a dict or transformers' ``SizeDict``), the unset left out."""
    items = value if isinstance(value, dict) else getattr(value, "__dict__", {})
    return {k: v for k, v in items.items() if v is not None}


def _within(value: Any, bound: Any) -> bool:
    """Whether the size ``value`` is no larger than ``bound``: numbers, or each field of a
    size dict no larger than the bound's same field (a field the bound lacks: larger)."""
    if bound is None:
        return False
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return isinstance(bound, (int, float)) and value <= bound
    if isinstance(value, dict):
        limits = _size_items(bound)
        return all(k in limits and _within(v, limits[k]) for k, v in value.items())
    return False


def content_hash(data: torch.Tensor) -> str:
    """sha256 of an encoder input's shape, dtype and values."""
    h = hashlib.sha256(f"{tuple(data.shape)}|{data.dtype}".encode())
    h.update(data.contiguous().numpy().tobytes())
    return h.hexdigest()


def images_of(multi_modal_data: Any) -> list[Any]:
    """The images of an ``LLM.generate`` / engine ``multi_modal_data`` value
    (``{"image": image or [images]}``, PIL images), checked; ``VLLMValidationError``
    naming ``multi_modal_data`` otherwise."""
    if multi_modal_data is None:
        return []
    if not isinstance(multi_modal_data, dict):
        raise VLLMValidationError(
            f"multi_modal_data must be a dict like {{'image': <PIL image or list>}}, got "
            f"{type(multi_modal_data).__name__}",
            PARAM,
        )
    unknown = sorted(set(multi_modal_data) - set(MODALITIES))
    if unknown:
        raise VLLMValidationError(
            f"multi_modal_data: modality {unknown[0]!r} is not supported (only 'image')",
            PARAM,
        )
    images = multi_modal_data.get("image")
    if images is None:
        return []
    if not isinstance(images, (list, tuple)):
        images = [images]
    from PIL import Image

    for i, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise VLLMValidationError(
                f"multi_modal_data['image'][{i}] must be a PIL image, got {type(image).__name__}",
                PARAM,
            )
    return [image.convert("RGB") for image in images]
