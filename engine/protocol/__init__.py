"""The client protocol: typed, versioned frames between clients and the engine.

Owns: the message schema (msgspec Structs, a tagged union) and the framing.
Leaves to others: sockets (``server.py``, ``client.py``) and meaning (runtime).

Framing: every frame is a 4-byte big-endian unsigned payload length followed by
that many bytes of MessagePack encoding one ``Message``. Frames above
``MAX_FRAME`` bytes are refused before any allocation. A connection opens with
``Hello`` from the client, answered by ``Welcome`` or an ``Error`` with code
``version_mismatch``. Every request carries an ``id`` chosen by the client; every
reply and event for it carries the same ``id`` (``req``), so one connection can
run many requests at once.

The events of one submitted message, in order: ``Accepted`` (it has a sequence
number), ``Durable`` (the user's message is on disk), then ``Token`` deltas,
``Notice`` (held / queued / refused, with the numbers), ``Durable`` receipts as
the reply's tokens reach disk, ``Committed`` (finished, with the reason), and a
last ``Durable`` covering the finish record.

Rooms: ``values`` (shared value types), ``operations`` (client -> engine),
``events`` (engine -> client), ``validation`` (ranges, ``validate``), ``framing``
(frames, ``Message``). Everything is re-exported here: ``from aotx.engine import protocol as P``.
"""

from aotx.engine.errors import ErrorCode  # noqa: F401 (re-exported)
from aotx.engine.protocol.values import (  # noqa: F401
    UNTIL_CONTEXT,
    REPEAT_PENALTY,
    SamplingParams,
    Constraint,
    CONSTRAINT_KINDS,
    CONVERSATION_ORIGINS,
    MAX_GRAMMAR_CHARS,
    MAX_CHOICES,
    MAX_TOP_LOGPROBS,
    MESSAGE_ROLES,
    CONTEXT_POLICIES,
    ContextCut,
    Attachment,
    Receipt,
    MessageView,
    ConversationView,
    BudgetLine,
    SlotView,
    ModelInfo,
)
from aotx.engine.protocol.operations import (  # noqa: F401
    Hello,
    PriorMessage,
    CLIENT_META_PREFIX,
    template_fields,
    CreateConversation,
    ListConversations,
    ShowConversation,
    SubmitMessage,
    CountTokens,
    Embed,
    Tokenize,
    Detokenize,
    POOLINGS,
    Cancel,
    DeleteConversation,
    RenameConversation,
    UpdateConversation,
    TruncateConversation,
    ForkConversation,
    Status,
    ListModels,
    LoadModel,
    UnloadModel,
    SwitchModel,
    SetContextPolicy,
    Operation,
    OPERATIONS,
)
from aotx.engine.protocol.events import (  # noqa: F401
    Welcome,
    Error,
    Ok,
    ConversationInfo,
    ConversationList,
    Accepted,
    Token,
    Notice,
    MediaInfo,
    Committed,
    Durable,
    StatusReply,
    ModelList,
    TokenCount,
    ModelLoaded,
    Embeddings,
    TokenList,
    Detokenized,
)
from aotx.engine.protocol.validation import (  # noqa: F401
    Limit,
    SAMPLING_LIMITS,
    SPECULATIVE_MODES,
    MAX_STOP_STRINGS,
    MAX_STOP_CHARS,
    MAX_LOGIT_BIAS,
    limit_problem,
    sampling_problem,
    constraint_problem,
    operation_problem,
    validate,
)
from aotx.engine.protocol.framing import (  # noqa: F401
    PROTOCOL_VERSION,
    MAX_FRAME,
    Message,
    encode_frame,
    decode_payload,
    frame_length,
)
