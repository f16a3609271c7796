"""The app's models, one module per wing; every name is importable from ``embeddings.models``."""
from .catalogue import (  # noqa: F401
    Lane,
    JobStatus,
    JobPriority,
    ImageStatus,
    TERMINAL_IMAGE_STATUSES,
    LIVE_ORIGINAL_STATUSES,
    JobKind,
    SpaceState,
    DUAL_EMBED_STATES,
    EmbeddingSpace,
    Job,
    Image,
    ChunkState,
    BulkChunk,
    BatchStat,
)
from .webhooks import (  # noqa: F401
    WebhookEvent,
    DeliveryStatus,
    WebhookEndpoint,
    WebhookDelivery,
    WebhookAttempt,
)
from .duplicates import (  # noqa: F401
    DuplicateKind,
    GroupStatus,
    ScanState,
    DuplicateScan,
    DuplicateEdge,
    DuplicateGroup,
    DuplicateMember,
    NotDuplicate,
)
from .batches import (  # noqa: F401
    FilePurpose,
    BatchFile,
    BatchStatus,
    Batch,
    PartState,
    BatchPart,
)
from .access import (  # noqa: F401
    SCOPES,
    ADMIN_SCOPE,
    USER_SCOPES,
    PRESETS,
    LIMIT_SETTINGS,
    BULK_WEIGHT_MIN,
    BULK_WEIGHT_MAX,
    ApiKey,
)
from .usage import (  # noqa: F401
    UsageKind,
    IMAGE_KINDS,
    UsageRecord,
)
