package dev.levee.client;

import dev.levee.v1.ErrorCode;

/**
 * A Levee error: the stable wire {@link ErrorCode} to branch on and the server's message for
 * people. Every error a server returns carries its code in the {@code levee-error-code}
 * trailer (proto/levee/v1/errors.proto); errors the client finds itself (validation of what the
 * server would refuse) carry the same code and the same message. One subclass per code, so
 * callers may catch {@link NotFound} or test {@link #code()}.
 */
public class LeveeException extends RuntimeException {
    private static final long serialVersionUID = 1L;

    private final ErrorCode code;
    private final String description;

    /** An error with a code and the message for people. */
    public LeveeException(ErrorCode code, String description) {
        this(code, description, null);
    }

    /** An error with a code, the message for people and its cause. */
    public LeveeException(ErrorCode code, String description, Throwable cause) {
        super(reasonOf(code) + " (" + code.getNumber() + "): " + description, cause);
        this.code = code;
        this.description = description;
    }

    /** The wire code. */
    public ErrorCode code() {
        return code;
    }

    /** The code's number, such as 1005. */
    public int codeNumber() {
        return code.getNumber();
    }

    /** The code's stable reason string, such as {@code NOT_FOUND}. */
    public String reason() {
        return reasonOf(code);
    }

    /** The message as the server sent it (without the reason and number). */
    public String description() {
        return description;
    }

    /** The reason string of a code: its name without {@code ERROR_CODE_}. */
    public static String reasonOf(ErrorCode code) {
        return code.name().replaceFirst("^ERROR_CODE_", "");
    }

    /**
     * The typed error of a code number; an unknown number (a newer server) is INTERNAL naming
     * it.
     */
    public static LeveeException of(int number, String description) {
        ErrorCode code = ErrorCode.forNumber(number);
        if (code == null || code == ErrorCode.UNRECOGNIZED) {
            return new Internal("unknown error code " + number + ": " + description);
        }
        return of(code, description);
    }

    /** The typed error of a code. */
    public static LeveeException of(ErrorCode code, String description) {
        switch (code) {
            case ERROR_CODE_INTERNAL: return new Internal(description);
            case ERROR_CODE_INVALID_ARGUMENT: return new InvalidArgument(description);
            case ERROR_CODE_UNAVAILABLE: return new Unavailable(description);
            case ERROR_CODE_RESOURCE_EXHAUSTED: return new ResourceExhausted(description);
            case ERROR_CODE_DEADLINE_EXCEEDED: return new DeadlineExceeded(description);
            case ERROR_CODE_NOT_FOUND: return new NotFound(description);
            case ERROR_CODE_ALREADY_EXISTS: return new AlreadyExists(description);
            case ERROR_CODE_FAILED_PRECONDITION: return new FailedPrecondition(description);
            case ERROR_CODE_STORAGE_FAILED: return new StorageFailed(description);
            case ERROR_CODE_UNIMPLEMENTED: return new Unimplemented(description);
            case ERROR_CODE_FENCED: return new Fenced(description);
            case ERROR_CODE_SEQUENCE_GAP: return new SequenceGap(description);
            case ERROR_CODE_SEQUENCE_TOO_OLD: return new SequenceTooOld(description);
            case ERROR_CODE_OFFSET_OUT_OF_RANGE: return new OffsetOutOfRange(description);
            default: return new LeveeException(code, description);
        }
    }

    /** The class {@link #of} gives for a code (tests check that every code has its own). */
    public static Class<? extends LeveeException> classOf(ErrorCode code) {
        return of(code, "").getClass();
    }

    /** A copy of this error (so that each waiting caller gets its own stack trace). */
    public LeveeException copy() {
        return of(code, description);
    }

    /** A bug or an unexpected failure inside the server (INTERNAL). */
    public static final class Internal extends LeveeException {
        private static final long serialVersionUID = 1L;
        public Internal(String description) { super(ErrorCode.ERROR_CODE_INTERNAL, description); }
    }

    /** The request is malformed or a field is out of range (INVALID_ARGUMENT). */
    public static final class InvalidArgument extends LeveeException {
        private static final long serialVersionUID = 1L;
        public InvalidArgument(String description) { super(ErrorCode.ERROR_CODE_INVALID_ARGUMENT, description); }
    }

    /** The server is shutting down, unreachable or not ready: retry later (UNAVAILABLE). */
    public static final class Unavailable extends LeveeException {
        private static final long serialVersionUID = 1L;
        public Unavailable(String description) { super(ErrorCode.ERROR_CODE_UNAVAILABLE, description); }
    }

    /** A server-wide bound was hit: back off and retry (RESOURCE_EXHAUSTED). */
    public static final class ResourceExhausted extends LeveeException {
        private static final long serialVersionUID = 1L;
        public ResourceExhausted(String description) { super(ErrorCode.ERROR_CODE_RESOURCE_EXHAUSTED, description); }
    }

    /** The call's deadline passed before it completed (DEADLINE_EXCEEDED). */
    public static final class DeadlineExceeded extends LeveeException {
        private static final long serialVersionUID = 1L;
        public DeadlineExceeded(String description) { super(ErrorCode.ERROR_CODE_DEADLINE_EXCEEDED, description); }
    }

    /** The named object does not exist (NOT_FOUND). */
    public static final class NotFound extends LeveeException {
        private static final long serialVersionUID = 1L;
        public NotFound(String description) { super(ErrorCode.ERROR_CODE_NOT_FOUND, description); }
    }

    /** The object to create exists already (ALREADY_EXISTS). */
    public static final class AlreadyExists extends LeveeException {
        private static final long serialVersionUID = 1L;
        public AlreadyExists(String description) { super(ErrorCode.ERROR_CODE_ALREADY_EXISTS, description); }
    }

    /** The system is not in a state to perform the request (FAILED_PRECONDITION). */
    public static final class FailedPrecondition extends LeveeException {
        private static final long serialVersionUID = 1L;
        public FailedPrecondition(String description) { super(ErrorCode.ERROR_CODE_FAILED_PRECONDITION, description); }
    }

    /** The server's storage failed; it refuses writes until it recovers (STORAGE_FAILED). */
    public static final class StorageFailed extends LeveeException {
        private static final long serialVersionUID = 1L;
        public StorageFailed(String description) { super(ErrorCode.ERROR_CODE_STORAGE_FAILED, description); }
    }

    /** The server does not implement the operation (UNIMPLEMENTED). */
    public static final class Unimplemented extends LeveeException {
        private static final long serialVersionUID = 1L;
        public Unimplemented(String description) { super(ErrorCode.ERROR_CODE_UNIMPLEMENTED, description); }
    }

    /** A commit by a member that no longer owns the partition (FENCED). */
    public static final class Fenced extends LeveeException {
        private static final long serialVersionUID = 1L;
        public Fenced(String description) { super(ErrorCode.ERROR_CODE_FENCED, description); }
    }

    /** An idempotent producer skipped sequence numbers (SEQUENCE_GAP). */
    public static final class SequenceGap extends LeveeException {
        private static final long serialVersionUID = 1L;
        public SequenceGap(String description) { super(ErrorCode.ERROR_CODE_SEQUENCE_GAP, description); }
    }

    /** An idempotent resend older than the server remembers (SEQUENCE_TOO_OLD). */
    public static final class SequenceTooOld extends LeveeException {
        private static final long serialVersionUID = 1L;
        public SequenceTooOld(String description) { super(ErrorCode.ERROR_CODE_SEQUENCE_TOO_OLD, description); }
    }

    /** An offset past the end of a queue, or an ack of an undelivered offset (OFFSET_OUT_OF_RANGE). */
    public static final class OffsetOutOfRange extends LeveeException {
        private static final long serialVersionUID = 1L;
        public OffsetOutOfRange(String description) { super(ErrorCode.ERROR_CODE_OFFSET_OUT_OF_RANGE, description); }
    }
}
