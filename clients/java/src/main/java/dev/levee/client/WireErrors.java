package dev.levee.client;

import dev.levee.v1.ErrorCode;
import io.grpc.Metadata;
import io.grpc.Status;
import io.grpc.StatusException;
import io.grpc.StatusRuntimeException;
import java.util.EnumMap;
import java.util.Map;
import java.util.concurrent.CancellationException;
import java.util.concurrent.ExecutionException;

/**
 * Reads Levee errors out of failed gRPC calls: the {@code levee-error-code} trailer when the
 * server sent one, else the gRPC status mapped as the Rust client's {@code code_from_grpc}
 * does (a status raised by the library, a proxy or the transport).
 */
public final class WireErrors {
    /** The trailer with the numeric ErrorCode, in decimal. */
    public static final Metadata.Key<String> ERROR_CODE_KEY =
            Metadata.Key.of("levee-error-code", Metadata.ASCII_STRING_MARSHALLER);
    /** The trailer with the code's reason string. */
    public static final Metadata.Key<String> ERROR_REASON_KEY =
            Metadata.Key.of("levee-error-reason", Metadata.ASCII_STRING_MARSHALLER);

    private static final Map<Status.Code, ErrorCode> CODE_FROM_GRPC = new EnumMap<>(Status.Code.class);

    static {
        CODE_FROM_GRPC.put(Status.Code.INVALID_ARGUMENT, ErrorCode.ERROR_CODE_INVALID_ARGUMENT);
        CODE_FROM_GRPC.put(Status.Code.OUT_OF_RANGE, ErrorCode.ERROR_CODE_OFFSET_OUT_OF_RANGE);
        CODE_FROM_GRPC.put(Status.Code.UNAVAILABLE, ErrorCode.ERROR_CODE_UNAVAILABLE);
        CODE_FROM_GRPC.put(Status.Code.CANCELLED, ErrorCode.ERROR_CODE_UNAVAILABLE);
        CODE_FROM_GRPC.put(Status.Code.ABORTED, ErrorCode.ERROR_CODE_UNAVAILABLE);
        CODE_FROM_GRPC.put(Status.Code.RESOURCE_EXHAUSTED, ErrorCode.ERROR_CODE_RESOURCE_EXHAUSTED);
        CODE_FROM_GRPC.put(Status.Code.DEADLINE_EXCEEDED, ErrorCode.ERROR_CODE_DEADLINE_EXCEEDED);
        CODE_FROM_GRPC.put(Status.Code.NOT_FOUND, ErrorCode.ERROR_CODE_NOT_FOUND);
        CODE_FROM_GRPC.put(Status.Code.ALREADY_EXISTS, ErrorCode.ERROR_CODE_ALREADY_EXISTS);
        CODE_FROM_GRPC.put(Status.Code.FAILED_PRECONDITION, ErrorCode.ERROR_CODE_FAILED_PRECONDITION);
        CODE_FROM_GRPC.put(Status.Code.PERMISSION_DENIED, ErrorCode.ERROR_CODE_FAILED_PRECONDITION);
        CODE_FROM_GRPC.put(Status.Code.UNIMPLEMENTED, ErrorCode.ERROR_CODE_UNIMPLEMENTED);
    }

    private WireErrors() {}

    /** The Levee error of a status and its trailers. */
    public static LeveeException fromStatus(Status status, Metadata trailers) {
        String details = status.getDescription() == null ? "" : status.getDescription();
        String number = trailers == null ? null : trailers.get(ERROR_CODE_KEY);
        if (number != null) {
            try {
                return LeveeException.of(Integer.parseInt(number.trim()), details);
            } catch (NumberFormatException ignored) {
                // fall through to the status
            }
        }
        if (status.getCode() == Status.Code.RESOURCE_EXHAUSTED && details.contains("message larger than max")) {
            return LeveeException.of(ErrorCode.ERROR_CODE_INVALID_ARGUMENT, details
                    + ": the message is over the size limit for this call; send less per message "
                    + "(the limits are in the proto comments)");
        }
        ErrorCode code = CODE_FROM_GRPC.getOrDefault(status.getCode(), ErrorCode.ERROR_CODE_INTERNAL);
        if (code == ErrorCode.ERROR_CODE_INTERNAL && brokenConnection(status, details)) {
            // Not the server's answer (it always sends its error code): the connection broke,
            // the node went away. Retryable, as any other lost connection.
            code = ErrorCode.ERROR_CODE_UNAVAILABLE;
        }
        String text = details.isEmpty() ? status.getCode().name() : details;
        if (status.getCause() != null && details.isEmpty()) {
            text = status.getCode().name() + ": " + status.getCause();
        }
        return LeveeException.of(code, text);
    }

    /**
     * Whether a status without Levee's error code says the connection broke under the call
     * (grpc-java reports a peer that died mid-call as INTERNAL "channel closed", or with the
     * I/O error as its cause).
     */
    private static boolean brokenConnection(Status status, String details) {
        return details.contains("channel closed")
                || details.contains("Connection reset")
                || status.getCause() instanceof java.io.IOException;
    }

    /** The Levee error of any failure of a call (a status, a wrapped one, or a bug). */
    public static LeveeException from(Throwable error) {
        Throwable cause = error;
        while ((cause instanceof ExecutionException || cause instanceof java.util.concurrent.CompletionException)
                && cause.getCause() != null) {
            cause = cause.getCause();
        }
        if (cause instanceof LeveeException) {
            return (LeveeException) cause;
        }
        if (cause instanceof StatusRuntimeException) {
            StatusRuntimeException status = (StatusRuntimeException) cause;
            return fromStatus(status.getStatus(), status.getTrailers());
        }
        if (cause instanceof StatusException) {
            StatusException status = (StatusException) cause;
            return fromStatus(status.getStatus(), status.getTrailers());
        }
        if (cause instanceof CancellationException) {
            return LeveeException.of(ErrorCode.ERROR_CODE_UNAVAILABLE, "the call was cancelled");
        }
        Status status = Status.fromThrowable(cause);
        if (status.getCode() != Status.Code.UNKNOWN) {
            return fromStatus(status, Status.trailersFromThrowable(cause));
        }
        return new LeveeException(ErrorCode.ERROR_CODE_INTERNAL, String.valueOf(cause), cause);
    }
}
