"""Turning user images into RGB PIL images, with an error that names the bad item."""
from __future__ import annotations

import contextlib
import hashlib
import io
import os

from PIL import Image, ImageFile, ImageOps


@contextlib.contextmanager
def strict_decoding():
    """Make PIL fail on truncated files inside the block.

    lmms-eval's task module sets ``ImageFile.LOAD_TRUNCATED_IMAGES = True`` process-wide; under it a cut-off
    PNG/JPEG silently decodes as a partly grey image and the model answers about a picture nobody asked about.
    """
    saved = ImageFile.LOAD_TRUNCATED_IMAGES
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        yield
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = saved


def load_image(image, index: int, name: str = "image") -> Image.Image:
    """One image (PIL image, path, or encoded bytes) as a fully decoded RGB PIL image (:func:`as_rgb`).

    A corrupt, truncated, unreadable or empty image is a ValueError naming batch item ``index`` (``"image 3 is
    corrupt ..."``; ``name`` in place of "image": a clip's frame, ``"clip 3: frame"``). A file or bytes is turned
    upright by its EXIF orientation (:func:`opened`), as transformers' ``load_image`` and ``datasets`` do; a PIL
    image is taken as it is, as the processor takes it.
    """
    try:
        if not isinstance(image, (Image.Image, str, os.PathLike, bytes, bytearray)):
            raise TypeError(f"expected a PIL image, a path or bytes, got {type(image).__name__}")
        with strict_decoding():  # decode now: truncated data fails here, not deep inside the processor
            img = image if isinstance(image, Image.Image) else opened(image)
            img.load()
        rgb = as_rgb(img)
    except Exception as err:  # PIL raises OSError, SyntaxError, ValueError... for bad data
        raise ValueError(f"{name} {index} is corrupt or unreadable: {type(err).__name__}: {err}") from err
    if min(rgb.size) < 1:
        raise ValueError(f"{name} {index} is empty (size {rgb.size})")
    return rgb


def opened(source) -> Image.Image:
    """An image file (path) or encoded bytes, decoded and turned upright by its EXIF orientation, as transformers'
    ``load_image`` and ``datasets``' image feature turn it (a phone photo saved sideways with a rotation tag reached
    the model sideways). Truncated data fails here under :func:`strict_decoding`."""
    img = Image.open(io.BytesIO(bytes(source)) if isinstance(source, (bytes, bytearray, memoryview)) else source)
    img.load()
    if img.getexif().get(0x0112) not in (None, 1):  # 0x0112: Orientation; 1 is upright
        img = ImageOps.exif_transpose(img)
    return img


def as_rgb(img: Image.Image) -> Image.Image:
    """An image as 8-bit RGB the way the models' processors make it: transparency composited onto white, as
    transformers' ``convert_to_rgb`` does (PIL's ``convert("RGB")`` drops the alpha, so a transparent diagram came
    out on black and unpruned answers differed from plain transformers'); 16-bit and float images scaled to 8 bits
    first (:func:`_eight_bit`), where ``convert("RGB")`` clips them (a 16-bit photo came out nearly all white, a float
    one in [0, 1] black)."""
    img = _eight_bit(img)
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return img.convert("RGB")


def _eight_bit(img: Image.Image) -> Image.Image:
    """A 16-bit or float single-band image as 8-bit grey ("L") by :func:`eight_bit`'s rule (the mode's pixel type:
    unsigned "I;16" / "I;16B" / "I;16L", signed "I;16S" and "I" 32-bit integers, "F" float). Other modes as they
    are."""
    import numpy as np

    if not (img.mode.startswith("I") or img.mode == "F"):
        return img
    return Image.fromarray(eight_bit(np.asarray(img)))  # "L"


# What :func:`eight_bit` converts at a time (elements): a float64 copy of this many, not of the whole clip
EIGHT_BIT_CHUNK = 2 ** 20


def eight_bit(pixels):
    """Pixel values as ``uint8``, the one rule for images (:func:`as_rgb`, by the PIL mode's pixel type) and clips'
    frames (``promprune.models.video.load_clip``, by the array's dtype, judged over the whole clip): ``uint8`` as it
    is; ``bool`` as 0 / 255 (PIL's "1"); ``uint16`` over its 16-bit range (v / 257, PIL's "I;16", "I;16B",
    "I;16L"); other integers (PIL's "I", and the signed "I;16S", which before this rule was divided as "I;16"
    always) the same where a value passes 255, else as they are; floats (PIL's "F") from [0, 1] (v * 255) where
    every finite value lies in it, else as they are; then clipped to [0, 255] (NaN as 0) and rounded. Casting instead
    made a float clip in [0, 1] all black, wrapped 16-bit values and -1 to 255.

    Computed in float64, :data:`EIGHT_BIT_CHUNK` elements at a time (whole rows of the first axis: a clip's frames),
    once for the range and once for the values: the arithmetic is elementwise, so each value is what a float64 copy of
    the whole array gave (that copy, with its finite values' and the steps' copies, was ~8x a float32 clip's size)."""
    import numpy as np

    a = np.asarray(pixels)
    if a.dtype == np.uint8:
        return a
    if a.dtype == np.bool_:
        return a.astype(np.uint8) * np.uint8(255)
    if a.dtype.kind not in "uif":
        raise TypeError(f"expected integer or float pixel values, got dtype {a.dtype}")
    sixteen_bit, is_float = a.dtype.kind == "u" and a.dtype.itemsize == 2, a.dtype.kind == "f"
    rows = a.reshape(1) if a.ndim == 0 else a  # a view: chunks are slices of its first axis
    step = max(1, EIGHT_BIT_CHUNK // max(1, rows[0].size)) if len(rows) else 1
    chunks = [slice(k, k + step) for k in range(0, len(rows), step)]
    low, top, any_finite = np.inf, -np.inf, False
    for chunk in chunks:
        part = rows[chunk].astype(np.float64)
        finite = part[np.isfinite(part)]
        if finite.size:
            any_finite = True
            low, top = min(low, float(finite.min())), max(top, float(finite.max()))
    if not any_finite:
        top = 0.0
    if is_float:
        scaled = any_finite and low >= 0.0 and top <= 1.0
    else:
        scaled = sixteen_bit or top > 255
    out = np.empty(rows.shape, np.uint8)
    for chunk in chunks:  # each step in place on the chunk's float64 copy: the same operations as on a whole copy
        part = rows[chunk].astype(np.float64)
        if scaled:
            if is_float:
                part *= 255.0
            else:
                part /= 257.0
        np.nan_to_num(part, copy=False)
        np.clip(part, 0, 255, out=part)
        out[chunk] = np.round(part, out=part)
    return out.reshape(a.shape)


# What one image is (a PIL image, a path, encoded bytes): passed bare where a batch (a list) is expected, it is refused
# rather than iterated (a path's characters, an image's "not iterable").
ONE_IMAGE = (Image.Image, str, os.PathLike, bytes, bytearray, memoryview)


def as_batch(value, name: str, one: str, single: tuple[type, ...]) -> list:
    """Argument ``name`` of a batch call (``images``, ``clips``, ``prompts``) as a list. One ``one`` passed bare (an
    instance of ``single``: a prompt string, an image or its path) or anything that is no sequence is a ValueError
    naming the argument: a prompt string was iterated as one prompt per character ("got 1 images but 5 prompts"),
    a bare image failed with a TypeError that named neither."""
    if isinstance(value, single) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be a list with one {one} per batch row (e.g. [{one}]), got "
                         f"{type(value).__name__} {_short(value)}: wrap a single {one} in a list")
    return list(value)


def _short(value) -> str:
    text = " ".join(repr(value).split())  # one line (an array's repr spans several)
    return text if len(text) <= 60 else text[:57] + "..."


def batch_lists(items, prompts, name: str = "images", one: str = "image",
                single: tuple[type, ...] = ONE_IMAGE) -> tuple[list, list]:
    """``(items, prompts)`` of a batch call as lists (:func:`as_batch`), prompts checked first (the common slip);
    ``items`` are images unless told otherwise (clips: ``promprune.models.video``)."""
    prompts = as_batch(prompts, "prompts", "prompt", (str, bytes, bytearray))
    return as_batch(items, name, one, single), prompts


def load_images(images, prompts) -> list[Image.Image]:
    """Validate a batch: one image per prompt (both lists, :func:`batch_lists`); returns RGB PIL images."""
    images, prompts = batch_lists(images, prompts)
    if len(images) != len(prompts):
        raise ValueError(f"got {len(images)} images but {len(prompts)} prompts; pass one image per prompt")
    if not images:
        raise ValueError("empty batch: pass at least one image and prompt")
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise ValueError(f"prompt {i} must be a str, got {type(p).__name__}")
    return [load_image(img, i) for i, img in enumerate(images)]


def pixel_key(image: Image.Image) -> int:
    """A 63-bit identity of an image: blake2b of its mode, size and pixel bytes. Exact integers, so the same on
    every machine, device and dtype the model runs in; equal pictures from different files share it."""
    digest = hashlib.blake2b(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode(), digest_size=8)
    digest.update(image.tobytes())
    return int.from_bytes(digest.digest(), "little") >> 1
