"""Audio in and out of the front end: decoding uploads, encoding speech, cutting text.

Decoding and encoding run here, not in the engine core: they are not MLX compute, and the
core then only ever sees float32 samples at its model's rate. PyAV (FFmpeg's libraries,
bundled in its wheels for Linux and macOS, so no system ffmpeg) reads every container
and codec ffmpeg does (wav, mp3, flac, ogg/opus, m4a/aac, webm...), resamples with
libswresample, and encodes the speech formats OpenAI's API offers, frame by frame, so a
long speech streams as it is made.
"""

from __future__ import annotations

import io
import re
from typing import Any

import numpy as np

from mlxd.core.errors import InvalidRequest, NotInstalled, PayloadTooLarge

# response_format -> (container, codec, sample rate or None for the model's)
SPEECH_FORMATS: dict[str, tuple[str, str, int | None]] = {
    "mp3": ("mp3", "libmp3lame", None),
    "flac": ("flac", "flac", None),
    "wav": ("wav", "pcm_s16le", None),
    "opus": ("ogg", "libopus", 48000),
    "aac": ("adts", "aac", None),
}
# Muxer options. Ogg's muxer holds packets until a page spans 1 s by default, so a short
# speech came out only at its end; 0.1 s pages stream (about 2 kbit/s of page headers).
MUXER_OPTIONS: dict[str, dict[str, str]] = {"opus": {"page_duration": "100000"}}
# OpenAI's pcm: raw 24 kHz 16-bit signed little-endian samples, no header
PCM_RATE = 24000
MEDIA_TYPES = {
    "mp3": "audio/mpeg",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "pcm": "audio/pcm",
}


def _av() -> Any:
    try:
        import av
    except ImportError as exc:  # pragma: no cover - the audio extra is missing
        raise NotInstalled(
            "audio needs the audio extra on this server (pip install 'mlxd[audio]')"
        ) from exc
    return av


def decode_audio(data: bytes, rate: int, *, max_seconds: float, param: str = "file") -> np.ndarray:
    """``data`` (any format FFmpeg reads) as mono float32 samples at ``rate`` Hz.

    A file that is not audio, or is broken, is a 400; one longer than ``max_seconds`` a
    413 (checked while decoding, so a long file is not decoded to the end first).
    """
    av = _av()
    if not data:
        raise InvalidRequest("the audio file is empty", param=param)
    limit = int(max_seconds * rate) + rate  # resampler latency
    parts: list[np.ndarray] = []
    total = 0
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            streams = container.streams.audio
            if not streams:
                raise InvalidRequest("the file holds no audio stream", param=param)
            resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
            for frame in container.decode(streams[0]):
                for out in resampler.resample(frame):
                    a = out.to_ndarray().reshape(-1)
                    parts.append(a)
                    total += a.size
                if total > limit:
                    raise PayloadTooLarge(
                        f"the audio is longer than this server accepts ({max_seconds:g} s; "
                        "audio.max_duration_s)",
                        param=param,
                    )
            for out in resampler.resample(None):
                parts.append(out.to_ndarray().reshape(-1))
    except av.error.FFmpegError as exc:
        raise InvalidRequest(
            f"could not decode the audio file ({exc.strerror or exc}); "
            "send wav, mp3, flac, ogg/opus, m4a or webm",
            param=param,
        ) from exc
    if not parts:
        raise InvalidRequest("the audio file holds no samples", param=param)
    samples = np.concatenate(parts).astype(np.float32, copy=False)
    if not np.isfinite(samples).all():
        raise InvalidRequest("the audio holds non-finite samples", param=param)
    return samples


# Cutting long files into Whisper windows (see window_bounds)
CUT_FRAME_S = 0.1  # the quiet stretch a cut is put in the middle of
CUT_QUIET_RATIO = 0.25  # its RMS against the searched seconds' RMS: below it, a pause


def window_bounds(
    samples: np.ndarray, rate: int, window_s: float, search_s: float
) -> list[tuple[int, int]]:
    """(start, end) sample offsets of the windows a file is transcribed in, in order.

    Whisper hears at most ``window_s`` (30 s) at a time, and this server decodes a file's
    windows independently (none waits for the text of the one before, so they share
    batches with each other and with other requests), so a cut through a word loses it on
    both sides. A window followed by more audio therefore ends in the middle of the
    quietest ``CUT_FRAME_S`` of its last ``search_s`` seconds when that stretch is a pause
    (its RMS under ``CUT_QUIET_RATIO`` of those seconds' RMS), and at ``window_s`` when
    there is none (continuous music, a steady tone): a steady signal has no better place.
    The last window ends with the file. ``search_s`` 0: every cut at ``window_s``.
    """
    n = int(samples.size)
    win = max(int(window_s * rate), 1)
    frame = max(int(CUT_FRAME_S * rate), 1)
    span = min(int(search_s * rate), win - 1)
    bounds: list[tuple[int, int]] = []
    start = 0
    while n - start > win:
        end = start + win
        cut = end
        if span >= frame:
            seg = samples[end - span : end].astype(np.float64)
            sq = np.concatenate(([0.0], np.cumsum(seg * seg)))
            power = (sq[frame:] - sq[:-frame]) / frame  # mean square of each frame-long run
            quiet = int(np.argmin(power))
            if power[quiet] < CUT_QUIET_RATIO**2 * (sq[-1] / span):
                cut = end - span + quiet + frame // 2
        bounds.append((start, cut))
        start = cut
    bounds.append((start, n))
    return bounds


class _Sink(io.RawIOBase):
    """A write-only file for PyAV's muxer; the bytes written so far are taken as they come."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.buf += b
        return len(b)

    def take(self) -> bytes:
        out = bytes(self.buf)
        self.buf.clear()
        return out


class SpeechEncoder:
    """Float32 pieces at ``rate`` in, bytes of ``fmt`` out, piece by piece (streamable).

    ``speed`` != 1 time-stretches (FFmpeg's ``atempo``, pitch kept) for models that have
    no speed control of their own.

    Streamed, the muxer cannot go back to the header: a wav's RIFF and data sizes stay
    FFmpeg's placeholder 0xFFFFFFFF (what OpenAI streams too; FFmpeg, browsers and Python's
    ``wave`` read the samples, though ``wave`` reports 2**31 - 1 frames), an mp3 has no
    frame count and a flac no total. ``whole=True`` (the caller has all the audio before
    anything is sent) writes into a seekable buffer and returns everything from
    ``finish``: FFmpeg then writes the real sizes, frame count and total.
    """

    def __init__(self, fmt: str, rate: int, speed: float = 1.0, *, whole: bool = False) -> None:
        av = _av()
        self.av = av
        self.fmt = fmt
        self.in_rate = rate
        self.out_rate = PCM_RATE if fmt == "pcm" else (SPEECH_FORMATS[fmt][2] or rate)
        self.resampler = av.AudioResampler(
            format="s16" if fmt == "pcm" else None, layout="mono", rate=self.out_rate
        )
        self.graph = self._tempo(speed) if abs(speed - 1.0) > 1e-3 else None
        self.pts = 0
        if fmt == "pcm":
            self.container = None
            return
        container, codec, _ = SPEECH_FORMATS[fmt]
        self.sink: _Sink | io.BytesIO = io.BytesIO() if whole else _Sink()
        self.container = av.open(
            self.sink, mode="w", format=container, options=MUXER_OPTIONS.get(fmt, {})
        )
        self.stream = self.container.add_stream(codec, rate=self.out_rate, layout="mono")

    def _tempo(self, speed: float) -> Any:
        graph = self.av.filter.Graph()
        src = graph.add_abuffer(
            format="flt", sample_rate=self.in_rate, layout="mono", time_base=f"1/{self.in_rate}"
        )
        chain = [src]
        s = speed
        while s > 2.0 or s < 0.5:  # atempo takes 0.5..2 per stage (older FFmpeg)
            step = 2.0 if s > 2.0 else 0.5
            chain.append(graph.add("atempo", str(step)))
            s /= step
        chain.append(graph.add("atempo", f"{s:.6f}"))
        chain.append(graph.add("abuffersink"))
        for a, b in zip(chain, chain[1:], strict=False):
            a.link_to(b)
        graph.configure()
        return graph

    def _frames(self, samples: np.ndarray | None) -> list[Any]:
        """Frames at the output rate (after the tempo filter) for ``samples`` (None: flush)."""
        av = self.av
        frames: list[Any] = []
        if samples is not None and samples.size:
            f = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(samples[None, :]), format="flt", layout="mono"
            )
            f.sample_rate = self.in_rate
            f.pts = self.pts
            self.pts += samples.size
            frames = [f]
        if self.graph is not None:
            out = []
            for f in frames or [None]:
                self.graph.push(f)
            while True:
                try:
                    out.append(self.graph.pull())
                except (av.error.BlockingIOError, av.error.EOFError):
                    break
            frames = out
        res = []
        for f in frames:
            if f is not None:
                f.pts = None
            res.extend(self.resampler.resample(f))
        if samples is None:
            res.extend(self.resampler.resample(None))
        return res

    def _encode(self, frames: list[Any], flush: bool = False) -> bytes:
        if self.container is None:
            return b"".join(bytes(f.to_ndarray().astype("<i2").tobytes()) for f in frames)
        for f in frames:
            for pkt in self.stream.encode(f):
                self.container.mux(pkt)
        if flush:
            for pkt in self.stream.encode(None):
                self.container.mux(pkt)
            self.container.close()
        if isinstance(self.sink, io.BytesIO):  # whole: everything at the end
            return self.sink.getvalue() if flush else b""
        return self.sink.take()

    def encode(self, samples: np.ndarray) -> bytes:
        return self._encode(self._frames(samples))

    def finish(self) -> bytes:
        return self._encode(self._frames(None), flush=True)


def split_text(text: str, max_chars: int) -> list[str]:
    """Speech input in pieces of at most ``max_chars`` characters, cut after sentence ends
    (then at spaces), so each piece is synthesised and streamed on its own."""
    sentences = [
        s.strip() for s in re.split(r"(?<=[.!?;:])\s+|\s*\n\s*", text.strip()) if s.strip()
    ]
    pieces: list[str] = []
    cur = ""
    for s in sentences:
        while len(s) > max_chars:
            cut = s.rfind(" ", 0, max_chars)
            cut = cut if cut > 0 else max_chars
            if cur:
                pieces.append(cur)
                cur = ""
            pieces.append(s[:cut].strip())
            s = s[cut:].strip()
        if cur and len(cur) + 1 + len(s) > max_chars:
            pieces.append(cur)
            cur = s
        else:
            cur = f"{cur} {s}" if cur else s
    if cur:
        pieces.append(cur)
    return pieces
