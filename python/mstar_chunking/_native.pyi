# The native module's functions the package's scripts call directly (the classes are typed in
# `__init__.pyi`, where the package exports them).
DEFAULT_MIN_CHUNK_TOKENS: int
DEFAULT_REQUEST_TIMEOUT_S: float

def _bench_facade(
    steps: int,
    decode_rows: int,
    prompts: int,
    prompt_tokens: int,
    budget: int,
    warm: int = 200,
    facade_timeout: bool = True,
    same_thread: bool = False,
) -> tuple[float, float]: ...
def _bench_trips(n: int, separate: bool = False, gap_us: float = 0.0) -> tuple[float, float]: ...
def _buffer_address(obj: object) -> int: ...
def __getattr__(name: str) -> object: ...
