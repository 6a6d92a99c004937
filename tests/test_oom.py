"""OOM classification and message parsing, on real message texts and real exceptions."""
import random

import pytest

from cuda_magic.devices.errors import find_oom, is_oom, message_kind, oom_kind
from cuda_magic.oom.messages import FATAL_NOTE, oom_fields, parse_oom_message
from cuda_magic.oom.findings import OomFields

from oom_messages import FATAL, MESSAGES, NOT_OOM

FIGURES = ("requested", "capacity", "free", "this_process", "other_processes", "allocated_by_torch",
           "reserved_unallocated", "reserved_total")


def _entry(fragment):
    return next(e for e in MESSAGES if fragment in e["source"])


def _ids(entries):
    return [e["source"].split("github.com/")[-1][:50] for e in entries]


# -- parsing the corpus ---------------------------------------------------------------------------

@pytest.mark.parametrize("entry", MESSAGES, ids=_ids(MESSAGES))
def test_corpus_message_parses_to_its_figures(entry):
    fields = parse_oom_message(entry["text"])
    expected = {name: entry["fields"].get(name) for name in FIGURES}
    assert {name: getattr(fields, name) for name in FIGURES} == expected
    assert fields.backend == entry["backend"]
    assert fields.device == entry["device"]
    assert fields.possible is (entry["kind"] == "possible")
    assert fields.message and fields.message in entry["text"]
    assert "\n" not in fields.message


@pytest.mark.parametrize("entry", MESSAGES, ids=_ids(MESSAGES))
def test_corpus_message_kind(entry):
    assert message_kind(entry["text"]) == entry["kind"]
    assert oom_kind(RuntimeError(entry["text"])) == entry["kind"]
    assert is_oom(RuntimeError(entry["text"]))


def test_corpus_covers_several_backends_and_forms():
    assert len(MESSAGES) >= 15
    assert {e["backend"] for e in MESSAGES} >= {"cuda", "hip", "mps", "xpu", "cublas", "cudnn", "cpu"}
    texts = " ".join(e["text"] for e in MESSAGES)
    for form in ("total capacty", "total capacity of", "reserved in total by PyTorch", "cached)",
                 "Process ", "not enough memory"):
        assert form in texts


def test_wrapped_message_keeps_the_line_that_says_out_of_memory():
    text = "Traceback (most recent call last):\n  File \"x.py\", line 1\n" + _entry("59778")["text"]
    fields = parse_oom_message(text)
    assert fields.message.startswith("CUDA out of memory. Tried to allocate 2.26 GiB")
    assert fields.requested == round(2.26 * 1024**3)


def test_allowed_figure_of_a_memory_fraction():
    text = ("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total capacity; 3.50 GiB "
            "already allocated; 10.00 GiB free; 4.00 GiB allowed; 3.60 GiB reserved in total by PyTorch)")
    fields = parse_oom_message(text)
    assert fields.allowed == 4 * 1024**3
    assert fields.free == 10 * 1024**3
    assert fields.reserved_total == round(3.60 * 1024**3)


def test_units_are_binary_and_bytes_are_exact():
    fields = parse_oom_message("HIP out of memory. Tried to allocate 512 bytes. GPU 3 has a total capacity "
                               "of 2.00 GB of which 8.00 KiB is free.")
    assert fields.requested == 512
    assert fields.capacity == 2 * 1024**3
    assert fields.free == 8 * 1024
    assert fields.device == "cuda:3"


@pytest.mark.parametrize("text", ["", "hello", "Tried to allocate lots", "GPU 0 has a total capacity of",
                                  "CUDA out of memory. Tried to allocate 1e9 MiB. GPU x",
                                  "\x00\xff" * 100, "CUDA out of memory. " * 5000])
def test_parsing_unknown_or_broken_text_gives_nones(text):
    fields = parse_oom_message(text)
    assert isinstance(fields, OomFields)
    assert fields.capacity is None and fields.free is None and fields.other_processes is None


def test_parsing_never_raises_on_truncated_messages_or_non_strings():
    rng = random.Random(0)
    for entry in MESSAGES:
        text = entry["text"]
        for cut in rng.sample(range(len(text)), 15):
            parse_oom_message(text[:cut])
            parse_oom_message(text[cut:])
    for value in (None, 12, b"CUDA out of memory", object()):
        assert isinstance(parse_oom_message(value), OomFields)


# -- classifying exceptions -----------------------------------------------------------------------

def test_torch_out_of_memory_error_is_oom_whatever_its_message():
    torch = pytest.importorskip("torch")
    assert oom_kind(torch.cuda.OutOfMemoryError("")) == "oom"
    assert oom_kind(torch.cuda.OutOfMemoryError("no figures")) == "oom"


def test_oom_class_recognised_by_name_without_torch():
    class OutOfMemoryError(RuntimeError):
        pass

    OutOfMemoryError.__module__ = "torch.cuda"
    assert oom_kind(OutOfMemoryError("x")) == "oom"

    class Subclass(OutOfMemoryError):
        pass

    Subclass.__module__ = "mylib"
    assert oom_kind(Subclass("x")) == "oom"
    OutOfMemoryError.__module__ = "mylib"
    assert oom_kind(OutOfMemoryError("x")) is None


def test_real_cpu_allocator_failure_is_oom_with_the_requested_bytes():
    torch = pytest.importorskip("torch")
    with pytest.raises(RuntimeError) as info:
        torch.empty(10**15, dtype=torch.float32)
    assert oom_kind(info.value) == "oom"
    fields = oom_fields(info.value)
    assert fields.backend == "cpu" and fields.device == "cpu"
    assert fields.requested == 4 * 10**15


def test_python_memory_error_is_a_cpu_oom():
    assert oom_kind(MemoryError()) == "oom"
    fields = oom_fields(MemoryError())
    assert fields.backend == "cpu" and fields.message == "MemoryError"


def test_numpy_memory_error_states_its_request():
    np = pytest.importorskip("numpy")
    with pytest.raises(MemoryError) as info:
        np.empty(10**15, dtype=np.float64)
    fields = oom_fields(info.value)
    assert fields.backend == "cpu"
    assert abs(fields.requested - 8 * 10**15) / (8 * 10**15) < 0.01


def test_real_simulated_device_oom_parses():
    torch = pytest.importorskip("torch")
    from cuda_magic.devices.simulated import SimulatedDevice

    with pytest.raises(torch.cuda.OutOfMemoryError) as info:
        with SimulatedDevice(64 * 2**20):
            kept = torch.empty(40 * 2**20, dtype=torch.uint8)
            torch.empty(30 * 2**20, dtype=torch.uint8)
    del kept
    fields = oom_fields(info.value)
    assert (fields.backend, fields.device) == ("simulated", "sim:0")
    assert fields.requested == 30 * 2**20
    assert fields.capacity == 64 * 2**20
    assert fields.free == 24 * 2**20
    assert fields.allocated_by_torch == 40 * 2**20


def _raise_chain(inner, outer_factory, explicit):
    try:
        try:
            raise inner
        except BaseException as e:
            if explicit:
                raise outer_factory() from e
            raise outer_factory()
    except BaseException as outer:
        return outer


@pytest.mark.parametrize("explicit", [True, False])
def test_oom_found_through_cause_and_context(explicit):
    entry = _entry("murong-xu/CADS")
    inner = RuntimeError(entry["text"])
    outer = _raise_chain(inner, lambda: ValueError("while saving a checkpoint"), explicit)
    assert oom_kind(outer) == "oom"
    assert is_oom(outer)
    assert find_oom(outer) is inner
    assert oom_fields(outer).requested == entry["fields"]["requested"]


def test_find_oom_prefers_a_definite_oom_over_a_possible_one():
    possible = RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.")
    definite = RuntimeError("CUDA out of memory. Tried to allocate 2.00 MiB")
    possible.__context__ = definite
    assert oom_kind(possible) == "oom"
    assert find_oom(possible) is definite
    assert find_oom(RuntimeError("CUDNN_STATUS_NOT_SUPPORTED")) is not None


def test_cycles_in_the_chain_terminate():
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__context__, b.__context__ = b, a
    assert oom_kind(a) is None
    b.__cause__ = RuntimeError("CUBLAS_STATUS_ALLOC_FAILED")
    assert oom_kind(a) == "oom"


def test_the_one_chain_walker_is_bounded_and_visits_each_once():
    from cuda_magic.devices.errors import CHAIN_LIMIT, exception_chain

    errors = [RuntimeError(f"step {i}") for i in range(CHAIN_LIMIT + 50)]
    for a, b in zip(errors, errors[1:]):
        a.__context__ = b
    errors[-1].__context__ = errors[0]          # and a cycle at the end
    walked = list(exception_chain(errors[0]))
    assert len(walked) == CHAIN_LIMIT and len({id(e) for e in walked}) == CHAIN_LIMIT
    assert walked[:3] == errors[:3]
    group = ExceptionGroup("g", [errors[0], ValueError("v")])
    assert list(exception_chain(group, limit=3)) == [group, errors[0], errors[1]]
    errors[5].__cause__ = RuntimeError("CUDA out of memory. Tried to allocate 2.00 MiB")
    assert oom_kind(errors[0]) == "oom"
    assert list(exception_chain(None)) == []


@pytest.mark.parametrize("text", FATAL)
def test_fatal_errors_are_not_oom_even_with_an_oom_in_the_chain(text):
    fatal = RuntimeError(text)
    assert oom_kind(fatal) == "fatal" and not is_oom(fatal) and find_oom(fatal) is None
    fatal.__context__ = RuntimeError(MESSAGES[0]["text"])
    assert oom_kind(fatal) == "fatal"
    assert oom_fields(fatal) is None
    assert "restart" in FATAL_NOTE


@pytest.mark.parametrize("text", NOT_OOM)
def test_other_errors_are_not_oom(text):
    assert oom_kind(RuntimeError(text)) is None
    assert not is_oom(RuntimeError(text))
    assert find_oom(RuntimeError(text)) is None
    assert oom_fields(RuntimeError(text)) is None


def test_exception_groups_and_odd_inputs():
    group = ExceptionGroup("workers", [ValueError("x"), RuntimeError(MESSAGES[0]["text"])])
    assert oom_kind(group) == "oom"
    assert oom_kind(None) is None and not is_oom(None)

    class Broken(Exception):
        def __str__(self):
            raise RuntimeError("broken __str__")

    assert oom_kind(Broken()) is None
    assert oom_kind(KeyboardInterrupt()) is None


def test_the_processes_a_message_lists_are_parsed():
    """torch's CUDA allocator lists the processes NVML sees on the device ("Process N has X memory in
    use", c10/cuda/CUDACachingAllocator.cpp reportProcessMemoryInfo): each is (pid, bytes)."""
    from oom_messages import MESSAGES

    from cuda_magic.oom.messages import parse_oom_message

    text = next(m["text"] for m in MESSAGES if m["source"].endswith("keys_values/issues/92"))
    fields = parse_oom_message(text)
    assert fields.processes == [(3721648, 414 * 2**20), (1374765, 414 * 2**20), (1374763, 414 * 2**20),
                                (1374764, 414 * 2**20)]
    assert parse_oom_message("CUDA out of memory. Tried to allocate 2.00 MiB").processes == []


# -- one classification: the guard's and `%gpumem --watch`'s ----------------------------------------

def test_the_watch_and_the_guard_agree_on_every_real_message():
    """`%gpumem --watch` marks a cell 'oom' exactly where the guard sees an out-of-memory error: both ask
    devices/errors.py, on the real messages (tests/oom_messages.py), alone and as the cause of another
    error, and on a numpy-style MemoryError (the watch used to look for "out of memory" in the text)."""
    import torch
    from IPython.core.interactiveshell import ExecutionResult

    from cuda_magic.memory import watch

    def chained(text):
        try:
            try:
                raise RuntimeError(text)
            except RuntimeError as inner:
                raise ValueError("the cell's own error") from inner
        except ValueError as outer:
            return outer

    errors = [RuntimeError(e["text"]) for e in MESSAGES] + [chained(e["text"]) for e in MESSAGES]
    errors += [RuntimeError(t) for t in FATAL + NOT_OOM] + [chained(t) for t in FATAL]
    errors += [MemoryError("Unable to allocate 8.00 GiB for an array with shape (1073741824,)"),
               torch.cuda.OutOfMemoryError("")]
    seen = {}
    for error in errors:
        result = ExecutionResult(None)
        result.error_in_exec = error
        guard = is_oom(error)
        assert watch._outcome(result) == ("oom" if guard else "error"), (guard, str(error)[:80])
        seen[guard] = seen.get(guard, 0) + 1
    assert seen == {True: 2 * len(MESSAGES) + 2, False: 2 * len(FATAL) + len(NOT_OOM)}
