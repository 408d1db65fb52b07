"""The audio logic a wrong answer would hide in: Whisper tokens -> segments, speech text ->
pieces, and the speech encoder's formats and tempo (PyAV)."""

from __future__ import annotations

import io

import numpy as np
import pytest

from mlxd.frontend.audio import SpeechEncoder, decode_audio, split_text

TS = 1000  # first timestamp token in these examples
EOT = 900


def test_segments_from_timestamp_pairs():
    from mlxd.engines.stt import split_segments

    toks = [TS + 0, 1, 2, TS + 50, TS + 50, 3, TS + 120]
    assert split_segments(toks, TS, EOT, 3.0) == [(0.0, 1.0, [1, 2]), (1.0, 2.4, [3])]


def test_segments_without_timestamps_or_a_closing_one_run_to_the_window_end():
    from mlxd.engines.stt import split_segments

    assert split_segments([1, 2, 3], TS, EOT, 7.5) == [(0.0, 7.5, [1, 2, 3])]
    assert split_segments([TS + 100, 4, 5], TS, EOT, 7.5) == [(2.0, 7.5, [4, 5])]
    # special tokens (>= eot, below the timestamps) are no text; stamps past the audio clamp
    assert split_segments([TS, 950, 6, TS + 1500], TS, EOT, 4.0) == [(0.0, 4.0, [6])]
    assert split_segments([TS, TS + 10], TS, EOT, 4.0) == []


@pytest.mark.parametrize(
    "text, limit, want",
    [
        ("One. Two! Three?", 300, ["One. Two! Three?"]),
        ("First sentence here. Second one here.", 25, ["First sentence here.", "Second one here."]),
        ("a" * 10 + " " + "b" * 10, 12, ["a" * 10, "b" * 10]),
        ("x" * 30, 12, ["x" * 12, "x" * 12, "x" * 6]),
        ("  Line one\nLine two  ", 9, ["Line one", "Line two"]),
    ],
)
def test_split_text(text, limit, want):
    out = split_text(text, limit)
    assert out == want and all(len(p) <= limit for p in out)


def _tone(seconds: float, rate: int) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * 440 * np.arange(int(seconds * rate)) / rate)).astype(
        np.float32
    )


@pytest.mark.parametrize("fmt", ["wav", "mp3", "flac", "opus", "aac"])
def test_speech_encoder_streams_decodable_audio(fmt):
    enc = SpeechEncoder(fmt, 32000)
    data = enc.encode(_tone(0.5, 32000)) + enc.encode(_tone(0.5, 32000)) + enc.finish()
    back = decode_audio(data, 16000, max_seconds=10)
    assert abs(back.size / 16000 - 1.0) < 0.08, (fmt, back.size)


def test_pcm_is_24khz_int16_and_speed_stretches_it():
    for speed, seconds in ((1.0, 1.0), (2.0, 0.5), (0.5, 2.0), (4.0, 0.25)):
        enc = SpeechEncoder("pcm", 32000, speed)
        data = enc.encode(_tone(1.0, 32000)) + enc.finish()
        assert len(data) % 2 == 0
        assert abs(len(data) / 2 / 24000 - seconds) < 0.03, (speed, len(data))


def test_decode_refuses_what_is_not_audio():
    from mlxd.core.errors import InvalidRequest, PayloadTooLarge

    with pytest.raises(InvalidRequest):
        decode_audio(b"", 16000, max_seconds=10)
    with pytest.raises(InvalidRequest):
        decode_audio(b"hello world, definitely not audio" * 50, 16000, max_seconds=10)
    enc = SpeechEncoder("wav", 16000)
    wav = enc.encode(_tone(3.0, 16000)) + enc.finish()
    with pytest.raises(PayloadTooLarge):
        decode_audio(wav, 16000, max_seconds=1)
    assert io.BytesIO(wav).read(4) == b"RIFF"


RATE = 1000  # window_bounds works in samples: a low rate keeps these arrays small


def _steady(seconds: float) -> np.ndarray:
    """A tone with a little noise: no stretch of it is quieter than the rest."""
    t = np.arange(int(seconds * RATE)) / RATE
    return (
        0.3 * np.sin(2 * np.pi * 97 * t) + 0.01 * np.random.RandomState(0).randn(t.size)
    ).astype(np.float32)


def _with_gap(seconds: float, at: float, length: float, level: float = 0.0) -> np.ndarray:
    x = _steady(seconds)
    x[int(at * RATE) : int((at + length) * RATE)] *= level
    return x


def test_window_bounds_without_a_pause_cut_every_30_seconds():
    from mlxd.frontend.audio import window_bounds

    w = 30 * RATE
    assert window_bounds(_steady(65), RATE, 30, 5) == [(0, w), (w, 2 * w), (2 * w, 65 * RATE)]
    assert window_bounds(_steady(30), RATE, 30, 5) == [(0, w)]  # exactly one window
    assert window_bounds(_steady(7), RATE, 30, 5) == [(0, 7 * RATE)]
    # search_s 0: fixed cuts even where there is a pause
    assert window_bounds(_with_gap(40, 27, 0.5), RATE, 30, 0) == [(0, w), (w, 40 * RATE)]


def test_window_bounds_cut_in_a_pause_of_the_last_seconds():
    from mlxd.frontend.audio import window_bounds

    # a 0.1 s silence at 27.0 s: its middle is the cut, and the next window starts there
    assert window_bounds(_with_gap(40, 27.0, 0.1), RATE, 30, 5) == [(0, 27050), (27050, 40 * RATE)]
    # a quieter stretch (-20 dB) counts as a pause too; the cuts chain over a long file
    # (the second window, 26.05 s to at most 56.05 s, finds the silence at 54 s)
    x = np.concatenate([_with_gap(28, 26.0, 0.1, level=0.1), _with_gap(40, 26.0, 0.1)])
    assert window_bounds(x, RATE, 30, 5) == [(0, 26050), (26050, 54050), (54050, 68000)]
    # a dip to half the amplitude (-6 dB) is no pause; nor is a silence earlier than the
    # searched last 5 s
    assert window_bounds(_with_gap(40, 27.0, 0.1, level=0.5), RATE, 30, 5)[0] == (0, 30000)
    assert window_bounds(_with_gap(40, 20.0, 0.5), RATE, 30, 5)[0] == (0, 30000)
