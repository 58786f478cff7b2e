package dev.levee.client;

import static org.junit.jupiter.api.Assertions.assertEquals;

import java.time.Duration;
import java.util.ArrayList;
import java.util.List;
import org.junit.jupiter.api.Test;

/** The idempotent producer's resend pauses, as the Rust producer's (docs/CLUSTER.md, "Clients"). */
class ProducerOptionsTest {
    @Test
    void given_the_defaults_when_resending_should_pause_10_ms_doubling_up_to_100_ms_ten_times() {
        ProducerOptions options = ProducerOptions.defaults();
        assertEquals(10, options.retriesMax);
        List<Long> pauses = new ArrayList<>();
        long pause = options.retryBackoff.toNanos();
        for (int resend = 0; resend < options.retriesMax; resend++) {
            pauses.add(Duration.ofNanos(pause).toMillis());
            pause = Producer.nextBackoff(pause, options.retryBackoffMax.toNanos());
        }
        assertEquals(List.of(10L, 20L, 40L, 80L, 100L, 100L, 100L, 100L, 100L, 100L), pauses);
        assertEquals(750L, pauses.stream().mapToLong(Long::longValue).sum(), "about 0.75 s of pauses in all");
    }

    @Test
    void given_a_first_pause_above_the_cap_when_resending_should_keep_it() {
        long second = Duration.ofMillis(500).toNanos();
        assertEquals(second, Producer.nextBackoff(second, Duration.ofMillis(100).toNanos()));
        assertEquals(Long.MAX_VALUE, Producer.nextBackoff(Long.MAX_VALUE, Long.MAX_VALUE));
    }
}
