"""The vision-feature cache: image features in the language model's space, keyed by image.

A conversation resends its images with every turn; the features of an image the model has
seen (the vision tower and projector's output) are kept, LRU, under the sha256 of the
image's bytes, so the vision encoder runs once per image and model.

How features come out of a model and go back in is family specific (mlx-vlm's models take
them back as ``cached_image_features`` in ``get_input_embeddings``):

* per image (Qwen2-VL, Qwen2.5-VL): ``pixel_values`` are the flattened patches of all
  images and ``image_grid_thw`` their grids; the vision tower attends within one image only,
  so each image is encoded alone and the features concatenated, which lets a request mix
  cached and new images.
* per request (models with ``encode_images``/``encode_image`` whose model code takes
  ``cached_image_features`` back, as mlx-vlm's own generate caches them; in mlx-vlm 0.7.10:
  deepseek_v4, gemma4, gemma4_unified, lfm2_vl, mimo_v2, minimax_m3_vl, muse_spark): one
  entry for the request's ordered set of images, so a hit needs the very same images in
  the same order.
* other families (SmolVLM/Idefics3, PaliGemma, LLaVA, Gemma 3, Qwen3-VL...): no cache;
  the model runs its encoder inside ``get_input_embeddings`` and every image counts as a
  miss. deepseek_v41 has ``encode_images`` but ignores ``cached_image_features``: caching
  for it would run the encoder twice per miss and still once per "hit", so it gets none.

Runs on the device worker thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import mlx.core as mx

# model_type -> how to encode one image of a request
_PER_IMAGE_GRID = frozenset({"qwen2_vl", "qwen2_5_vl"})


def _nbytes(features: Any) -> int:
    if isinstance(features, mx.array):
        return features.nbytes
    if isinstance(features, (list, tuple)):
        return sum(_nbytes(f) for f in features)
    if isinstance(features, dict):
        return sum(_nbytes(f) for f in features.values())
    return 0


class FeatureCache:
    """An LRU of features bounded by entries and bytes; one per loaded vision model."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self.nbytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def get(self, key: str) -> Any:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key: str, features: Any) -> None:
        if not self.enabled:
            return
        size = _nbytes(features)
        if size > self.max_bytes:
            return  # larger than the whole cache: keeping it would evict everything
        old = self._items.pop(key, None)
        if old is not None:
            self.nbytes -= old[1]
        self._items[key] = (features, size)
        self.nbytes += size
        while len(self._items) > self.max_entries or self.nbytes > self.max_bytes:
            _, (_, n) = self._items.popitem(last=False)
            self.nbytes -= n

    def clear(self) -> None:
        self._items.clear()
        self.nbytes = 0


class FeatureEncoder:
    """Computes (and caches) the image features of one request for a given model."""

    def __init__(self, model: Any, cache: FeatureCache) -> None:
        self.model = model
        self.cache = cache
        model_type = str(getattr(model.config, "model_type", ""))
        if model_type in _PER_IMAGE_GRID and hasattr(model, "vision_tower"):
            self.mode = "per_image"
        elif (
            hasattr(model, "encode_images") or hasattr(model, "encode_image")
        ) and _takes_cached_features(model):
            self.mode = "per_request"
        else:
            self.mode = None
        self.encoder_runs = 0  # images the vision encoder ran for

    @property
    def caches(self) -> bool:
        return self.mode is not None and self.cache.enabled

    def cached_count(self, digests: list[str]) -> int:
        """How many of these images would come from the cache (no encoder run)."""
        if not digests or not self.caches:
            return 0
        if self.mode == "per_image":
            return sum(1 for d in digests if d in self.cache)
        return len(digests) if _request_key(digests) in self.cache else 0

    def features(self, inputs: dict, digests: list[str]) -> tuple[Any, int, int]:
        """(features for ``cached_image_features`` or None, hits, misses)."""
        pixel_values = inputs.get("pixel_values")
        if not digests or pixel_values is None:
            return None, 0, 0
        if not self.caches:
            self.encoder_runs += len(digests)
            return None, 0, len(digests)
        if self.mode == "per_image":
            return self._per_image(inputs, pixel_values, digests)
        key = _request_key(digests)
        cached = self.cache.get(key)
        if cached is not None:
            return cached, len(digests), 0
        kwargs = {
            k: v
            for k, v in inputs.items()
            if k not in ("input_ids", "pixel_values", "attention_mask")
        }
        if hasattr(self.model, "encode_images"):
            feats = self.model.encode_images(pixel_values, **kwargs)
        else:
            feats = self.model.encode_image(pixel_values)
        mx.eval(feats)
        self.encoder_runs += len(digests)
        self.cache.put(key, feats)
        return feats, 0, len(digests)

    def _per_image(
        self, inputs: dict, pixel_values: mx.array, digests: list[str]
    ) -> tuple[Any, int, int]:
        grid = inputs.get("image_grid_thw")
        if grid is None or grid.shape[0] != len(digests):
            self.encoder_runs += len(digests)
            return None, 0, len(digests)  # not the layout we know: let the model encode
        rows = [int(t * h * w) for t, h, w in grid.tolist()]
        if sum(rows) != pixel_values.shape[0]:
            self.encoder_runs += len(digests)
            return None, 0, len(digests)
        tower = self.model.vision_tower
        dtype = tower.patch_embed.proj.weight.dtype
        feats, hits, misses, start = [], 0, 0, 0
        for i, (digest, n) in enumerate(zip(digests, rows, strict=True)):
            f = self.cache.get(digest)
            if f is None:
                f = tower(
                    pixel_values[start : start + n].astype(dtype),
                    grid[i : i + 1],
                    output_hidden_states=False,
                )
                mx.eval(f)
                self.cache.put(digest, f)
                self.encoder_runs += 1
                misses += 1
            else:
                hits += 1
            feats.append(f)
            start += n
        return (feats[0] if len(feats) == 1 else mx.concatenate(feats, axis=0)), hits, misses


def _takes_cached_features(model: Any) -> bool:
    """Whether the model's own code reads ``cached_image_features`` (mlx-vlm's families
    that do read it in ``get_input_embeddings``; those that do not would re-encode)."""
    import inspect

    try:
        source = inspect.getsource(inspect.getmodule(type(model)))
    except (OSError, TypeError):
        return False
    return "cached_image_features" in source


def _request_key(digests: list[str]) -> str:
    return "req:" + "+".join(digests)
