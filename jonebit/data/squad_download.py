"""Downloads the official SQuAD v1.1 files and verifies their size and sha256.

The files come from the SQuAD explorer site (``https://rajpurkar.github.io/SQuAD-explorer/dataset/``). A file is
streamed to ``NAME.part`` next to its destination, hashed on the way, and renamed into place only when both the
byte count and the sha256 match the official values below; a partial or corrupt download is deleted and reported.
A destination that already exists is verified instead of downloaded again, and left alone (with an error) when it
does not match, so nothing the user has is overwritten.
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.client
import logging
import os
import pathlib
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence

log = logging.getLogger(__name__)

OFFICIAL_BASE_URL = "https://rajpurkar.github.io/SQuAD-explorer/dataset/"


@dataclasses.dataclass(frozen=True)
class OfficialFile:
    """A file to fetch and the size and digest it must have."""

    name: str
    size: int
    sha256: str


SQUAD_V1_1 = {
    "train": OfficialFile("train-v1.1.json", 30_288_272,
                          "3527663986b8295af4f7fcdff1ba1ff3f72d07d61a20f487cb238a6ef92fd955"),
    "dev": OfficialFile("dev-v1.1.json", 4_854_279,
                        "95aa6a52d5d6a735563366753ca50492a658031da74f301ac5238b03966972c9"),
}


class DownloadError(RuntimeError):
    """A download failed or gave a file other than the official one."""


def _digest(path: pathlib.Path) -> tuple[int, str]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def verify_file(path: str | os.PathLike, expected: OfficialFile) -> None:
    """Raises :class:`DownloadError` unless ``path`` has the expected size and sha256."""
    size, sha = _digest(pathlib.Path(path))
    if size != expected.size:
        raise DownloadError(f"{path}: {size:,} bytes, but the official {expected.name} has {expected.size:,} "
                            "(partial or different file); delete it and download again")
    if sha != expected.sha256:
        raise DownloadError(f"{path}: sha256 {sha}, but the official {expected.name} has {expected.sha256} "
                            "(corrupt or different file); delete it and download again")


def _fetch(url: str, part: pathlib.Path, expected: OfficialFile, opener: Callable, timeout: float) -> None:
    h, size = hashlib.sha256(), 0
    try:
        with opener(url, timeout=timeout) as response, open(part, "wb") as out:
            for chunk in iter(lambda: response.read(1 << 20), b""):
                size += len(chunk)
                if size > expected.size:
                    raise DownloadError(f"{url}: more than the official {expected.size:,} bytes of "
                                        f"{expected.name}; not the official file")
                h.update(chunk)
                out.write(chunk)
    except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
        raise DownloadError(f"could not download {url}: {e}") from e
    if size != expected.size:
        raise DownloadError(f"{url}: got {size:,} bytes, the official {expected.name} has {expected.size:,} "
                            "(the download was cut short); try again")
    if h.hexdigest() != expected.sha256:
        raise DownloadError(f"{url}: sha256 {h.hexdigest()}, the official {expected.name} has {expected.sha256}; "
                            "the server sent a different file")


def download_squad(
    directory: str | os.PathLike,
    splits: Sequence[str] = ("train", "dev"),
    *,
    base_url: str = OFFICIAL_BASE_URL,
    files: Mapping[str, OfficialFile] = SQUAD_V1_1,
    opener: Callable | None = None,
    timeout: float = 60.0,
) -> dict[str, pathlib.Path]:
    """Fetches the SQuAD v1.1 ``splits`` into ``directory``, verified.

    Args:
      directory: where the files go (created if needed).
      splits: any of ``"train"`` and ``"dev"``.
      base_url: the URL the file names are appended to.
      files: split -> expected file; the official ones by default.
      opener: a replacement for ``urllib.request.urlopen`` (the default), with its call signature.
      timeout: seconds to wait on the network per read.

    Returns:
      split -> path of the verified file.
    """
    opener = opener or urllib.request.urlopen
    unknown = [s for s in splits if s not in files]
    if unknown or not splits:
        raise ValueError(f"splits: expected some of {sorted(files)}, got {list(splits)}")
    directory = pathlib.Path(directory)
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"directory: {directory} exists and is not a directory")
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for split in splits:
        expected = files[split]
        dest = directory / expected.name
        if dest.exists():
            verify_file(dest, expected)
            log.info("%s: already present and verified", dest)
            out[split] = dest
            continue
        part = dest.with_name(dest.name + ".part")
        url = base_url.rstrip("/") + "/" + expected.name
        log.info("downloading %s", url)
        try:
            _fetch(url, part, expected, opener, timeout)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        os.replace(part, dest)
        out[split] = dest
    return out
