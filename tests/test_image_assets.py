"""Image pointers to a tenant's own assets (checkpoints.assets): the location policy as a table over
both stores, and the bounded local read (size, links, non-files). The S3 read runs against moto's
server in tests/test_scale_out_stack.py; the whole path through the API in tests/test_vision_stack.py."""

from __future__ import annotations

import io
import os

import pytest
from PIL import Image

from api import images
from api.datums import RawDatum, RawImage
from bases.vision import ImageGeometry, ImageLimits
from checkpoints.assets import MAX_NAME_CHARS, AssetPlace, asset_name, read_asset
from core.errors import InvalidInput, NotFound

S3 = AssetPlace("s3", bucket="quilt-bucket", prefix="quilt/assets")
LOCAL = AssetPlace("local", root="/srv/quilt/assets")
OWN_S3 = "s3://quilt-bucket/quilt/assets/ten-a/"
OWN_LOCAL = "/srv/quilt/assets/ten-a/"
F = "data[0].model_input.images[0].location"


@pytest.mark.parametrize("place,location,name", [
    (S3, OWN_S3 + "cat.png", "cat.png"),
    (S3, OWN_S3 + "run-1/images/cat.png", "run-1/images/cat.png"),
    (S3, OWN_S3 + "a..b.png", "a..b.png"),  # dots inside a part climb nowhere
    (LOCAL, OWN_LOCAL + "cat.png", "cat.png"),
    (LOCAL, OWN_LOCAL + "dir/x.jpeg", "dir/x.jpeg"),
    (AssetPlace("s3", bucket="b", prefix=""), "s3://b/ten-a/x.png", "x.png"),  # no key prefix
])
def test_own_prefix_locations_name_an_asset(place, location, name):
    assert asset_name(F, location, "ten-a", place) == name


@pytest.mark.parametrize("place,location,words", [
    (S3, "https://example.com/cat.png", "fetches nothing from another host"),
    (S3, "http://169.254.169.254/latest/meta-data", "fetches nothing from another host"),
    (S3, "HTTPS://example.com/cat.png", "fetches nothing from another host"),
    (S3, "file:///etc/passwd", "outside your asset prefix"),
    (S3, "s3://other-bucket/quilt/assets/ten-a/cat.png", "outside your asset prefix"),
    (S3, "s3://quilt-bucket/quilt/assets/ten-b/cat.png", "outside your asset prefix"),  # another tenant
    (S3, "s3://quilt-bucket/quilt/assets/ten-ab/cat.png", "outside your asset prefix"),  # a tenant id sharing a start
    (S3, "s3://quilt-bucket/quilt/checkpoints/ten-a/m/weights/x/v/adapter_model.safetensors", "outside your asset"),
    (S3, "s3://quilt-bucket/quilt/assets/ten-a", "outside your asset prefix"),  # the prefix itself
    (S3, OWN_S3 + "../ten-b/cat.png", "'..' parts"),
    (S3, OWN_S3 + "x/../../ten-b/cat.png", "'..' parts"),
    (S3, OWN_S3 + "./cat.png", "'.' or '..' parts"),
    (S3, OWN_S3 + "x//cat.png", "empty"),
    (S3, OWN_S3, "empty"),
    (S3, OWN_S3 + "%2e%2e/ten-b/cat.png", "percent-encoding"),
    (S3, OWN_S3 + "..%2Ften-b%2Fcat.png", "percent-encoding"),
    (S3, OWN_S3 + "..\\ten-b\\cat.png", "backslashes"),
    (S3, OWN_S3 + "cat.png\x00.txt", "NUL"),
    (S3, OWN_S3 + "cat\n.png", "control characters"),
    (S3, OWN_S3 + "x" * (MAX_NAME_CHARS + 1), f"limit of {MAX_NAME_CHARS}"),
    (LOCAL, "/etc/passwd", "outside your asset prefix"),
    (LOCAL, "/srv/quilt/assets/ten-b/cat.png", "outside your asset prefix"),
    (LOCAL, OWN_LOCAL + "../ten-b/cat.png", "'..' parts"),
    (LOCAL, "file://" + OWN_LOCAL + "cat.png", "outside your asset prefix"),
    (LOCAL, OWN_S3 + "cat.png", "outside your asset prefix"),  # the other store's form
])
def test_locations_outside_the_own_prefix_are_refused_by_name(place, location, words):
    with pytest.raises(InvalidInput) as exc:
        asset_name(F, location, "ten-a", place)
    assert words in str(exc.value), str(exc.value)
    assert exc.value.field == F


def _png(w: int = 40, h: int = 30) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 30)).save(out, "PNG")
    return out.getvalue()


def test_local_reads_are_bounded_and_stay_in_the_prefix(tmp_path):
    place = AssetPlace("local", root=str(tmp_path))
    own, other = tmp_path / "ten-a", tmp_path / "ten-b"
    own.mkdir()
    other.mkdir()
    (own / "cat.png").write_bytes(b"x" * 100)
    (other / "secret.png").write_bytes(b"s" * 10)
    assert read_asset(F, place, "ten-a", "cat.png", 100) == b"x" * 100
    with pytest.raises(InvalidInput, match="holds 100 bytes, over the limit of 99 bytes"):
        read_asset(F, place, "ten-a", "cat.png", 99)
    with pytest.raises(NotFound):
        read_asset(F, place, "ten-a", "absent.png", 100)
    os.symlink(other / "secret.png", own / "link.png")  # a link out of the prefix reads nothing
    with pytest.raises(NotFound):
        read_asset(F, place, "ten-a", "link.png", 100)
    (own / "dir").mkdir()
    with pytest.raises(NotFound):
        read_asset(F, place, "ten-a", "dir", 100)
    os.mkfifo(own / "fifo")  # opening a FIFO for reading would wait for a writer
    with pytest.raises(NotFound):
        read_asset(F, place, "ten-a", "fifo", 100)


def test_a_pointer_to_an_own_asset_becomes_the_same_image_tokens(tmp_path):
    from stack.tiny_model import TinyModelSpec, build_tiny_model

    vl = build_tiny_model(tmp_path / "vl", spec=TinyModelSpec(architecture="qwen3_vl", num_layers=1)).path
    geo = ImageGeometry.of_directory(vl)
    pic = _png()
    (tmp_path / "assets" / "ten-a").mkdir(parents=True)
    (tmp_path / "assets" / "ten-a" / "cat.png").write_bytes(pic)
    reader = images.AssetReader("ten-a", AssetPlace("local", root=str(tmp_path / "assets")))
    limits = ImageLimits(max_bytes=200_000, max_pixels=1_000_000)

    def expand(location: str, limits: ImageLimits = limits) -> RawDatum:
        datum = RawDatum([5, 6, 7], {}, raw_images=(RawImage(1, "png", None, location=location),))
        return images.expand([datum], geo, limits, 4, reader)[0]

    inline = images.expand([RawDatum([5, 6, 7], {}, raw_images=(RawImage(1, "png", pic),))], geo, limits, 4)[0]
    assert expand(str(tmp_path / "assets" / "ten-a" / "cat.png")) == inline
    with pytest.raises(InvalidInput, match=f"over the limit of {len(pic) - 1} bytes") as exc:
        expand(str(tmp_path / "assets" / "ten-a" / "cat.png"), ImageLimits(len(pic) - 1, 1_000_000))
    assert exc.value.field == "data[0].model_input.images[0].location"
    with pytest.raises(InvalidInput, match="outside your asset prefix"):
        expand(str(tmp_path / "assets" / "ten-b" / "cat.png"))
    with pytest.raises(InvalidInput, match="not a readable png"):  # the chunk's format is still checked
        (tmp_path / "assets" / "ten-a" / "fake.png").write_bytes(b"\0" * 64)
        expand(str(tmp_path / "assets" / "ten-a" / "fake.png"))
