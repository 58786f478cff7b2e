package dev.levee.client;

import dev.levee.v1.ErrorCode;
import dev.levee.v1.GetClusterResponse;
import dev.levee.v1.Member;
import java.time.Duration;
import java.util.ArrayList;
import java.util.Iterator;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.concurrent.TimeUnit;

/**
 * What a stream that follows the cluster ({@link LeveeClient#subscribeFollowing},
 * {@link LeveeClient#subscribeManyFollowing}, {@link GroupConsumer#following}) keeps to open
 * itself again through another node when its node goes away: the cluster's members, learned
 * from the node the stream was opened through or from the members known, tried in turn, as the
 * Rust client's {@code following.rs}. It owns a channel to each member other than that node
 * (closed with the stream, or when the group consumer's run returns).
 */
final class Following implements AutoCloseable {
    /** Longest one move tries to open the stream again before it gives up. */
    static final Duration REOPEN_WITHIN = Duration.ofSeconds(30);
    /** Pause between two rounds over the members while none takes the stream. */
    private static final long REOPEN_PAUSE_MS = 100;
    /** Rounds over the members in one move: the pauses alone fill {@link #REOPEN_WITHIN}. */
    private static final long REOPEN_ROUNDS_MAX = REOPEN_WITHIN.toMillis() / REOPEN_PAUSE_MS + 1;
    /** Longest one member may take to answer GetCluster. */
    private static final Duration LEARN_TIMEOUT = Duration.ofSeconds(1);
    /** Longest one try through one member may wait for the stream to open (and its queues added). */
    private static final Duration TRY_WAIT_MAX = Duration.ofSeconds(10);
    /** Channels to members kept at once; beyond, those of members gone are closed. */
    private static final int MEMBER_CLIENTS_MAX = 64;

    /** Opens the stream again through one member, waiting at most the given nanoseconds. */
    @FunctionalInterface
    interface Opener {
        void open(LeveeClient member, long waitNanos);
    }

    /** The node the stream was opened through (the application's client: never closed here). */
    private final LeveeClient seed;
    /** The members' API addresses, as last learned. */
    private List<String> known = List.of();
    /** A channel to each member other than the seed, by address. */
    private final Map<String, LeveeClient> clients = new LinkedHashMap<>();
    /** The member to try first at the next move. */
    private int next;
    /** The address the stream is open through now. */
    private String current;
    private volatile boolean closed;

    private Following(LeveeClient seed) {
        this.seed = seed;
        this.current = seed.address();
    }

    /** The members as {@code seed} says now. */
    static Following learnedFrom(LeveeClient seed) {
        Following following = new Following(seed);
        following.learn();
        return following;
    }

    /** Whether {@code error} means the stream's node went away (not a refusal of what was asked). */
    static boolean nodeWentAway(LeveeException error) {
        return error.code() == ErrorCode.ERROR_CODE_UNAVAILABLE;
    }

    private LeveeClient clientOf(String address) {
        if (address.equals(seed.address())) {
            return seed;
        }
        return clients.computeIfAbsent(address, ignored -> LeveeClient.lazy(address, seed.options(), ""));
    }

    /**
     * Learns the members again: from the seed, else from any member known; keeps the last list
     * known when none answers.
     */
    synchronized void learn() {
        List<LeveeClient> asked = new ArrayList<>();
        asked.add(seed);
        for (String address : known) {
            if (!address.equals(seed.address())) {
                asked.add(clientOf(address));
            }
        }
        for (LeveeClient client : asked) {
            GetClusterResponse cluster;
            try {
                cluster = client.withRequestTimeout(LEARN_TIMEOUT).clusterStatus();
            } catch (LeveeException unreachable) {
                continue;
            }
            List<String> members = new ArrayList<>();
            for (Member member : cluster.getMembersList()) {
                if (!member.getGrpcAddr().isEmpty()) {
                    members.add(member.getGrpcAddr());
                }
            }
            if (!members.isEmpty()) {
                known = List.copyOf(members);
                forgetGone();
                return;
            }
        }
        if (known.isEmpty()) {
            known = List.of(seed.address());
        }
    }

    /** Closes the channels of members gone, once more than {@link #MEMBER_CLIENTS_MAX} are kept. */
    private void forgetGone() {
        Iterator<Map.Entry<String, LeveeClient>> entries = clients.entrySet().iterator();
        while (clients.size() > MEMBER_CLIENTS_MAX && entries.hasNext()) {
            Map.Entry<String, LeveeClient> entry = entries.next();
            if (!known.contains(entry.getKey()) && !entry.getKey().equals(current)) {
                entry.getValue().close();
                entries.remove();
            }
        }
    }

    /** Whether {@code member} answers GetServerInfo within {@code probe}. */
    static boolean answers(LeveeClient member, Duration probe) {
        try {
            member.withRequestTimeout(probe).serverInfo();
            return true;
        } catch (LeveeException unreachable) {
            return false;
        }
    }

    /**
     * The member to go on through, as the Rust client's {@code Members::next_member}: learns
     * the members again, then returns the first after the current one (in the order learned)
     * that answers within {@code probe}, the current one last; the seed when none answers.
     */
    synchronized LeveeClient nextMember(Duration probe) {
        learn();
        int count = known.size();
        int at = known.indexOf(current);
        int first = at >= 0 ? at + 1 : next;
        for (int step = 0; step < count; step++) {
            int index = (first + step) % count;
            String address = known.get(index);
            LeveeClient member = clientOf(address);
            if (answers(member, probe)) {
                next = (index + 1) % count;
                current = address;
                return member;
            }
        }
        current = seed.address();
        return seed;
    }

    /**
     * Tries {@code opener} on each member in turn (the one after the last that took the stream
     * first), learning the members again before each round, until one opens the stream or
     * {@link #REOPEN_WITHIN} has passed: then throws {@code cause}'s code, saying so.
     */
    synchronized void reopen(Opener opener, LeveeException cause) {
        long started = System.nanoTime();
        long deadline = started + REOPEN_WITHIN.toNanos();
        LeveeException last = cause;
        for (long round = 0; round < REOPEN_ROUNDS_MAX && !closed; round++) {
            learn();
            int count = known.size();
            for (int step = 0; step < count && !closed; step++) {
                String address = known.get((next + step) % count);
                long left = Math.max(deadline - System.nanoTime(), TimeUnit.SECONDS.toNanos(1));
                long waitNanos = Math.min(left, Math.min(TRY_WAIT_MAX.toNanos(), seed.options().requestTimeout().toNanos()));
                try {
                    opener.open(clientOf(address), waitNanos);
                    next = (next + step + 1) % count;
                    current = address;
                    return;
                } catch (LeveeException failed) {
                    last = failed;
                }
            }
            if (System.nanoTime() - deadline >= 0) {
                break;
            }
            try {
                Thread.sleep(REOPEN_PAUSE_MS);
            } catch (InterruptedException interrupted) {
                Thread.currentThread().interrupt();
                throw LeveeException.of(ErrorCode.ERROR_CODE_UNAVAILABLE, cause.description()
                        + "; interrupted while opening the stream again through another member");
            }
        }
        throw LeveeException.of(cause.code(), cause.description() + "; the stream's node went away and no member of "
                + "the cluster " + known + " took it again within " + REOPEN_WITHIN.toSeconds() + " s"
                + (closed ? " (the stream was closed)" : "") + (last == cause ? "" : " (the last try: " + last.description() + ")"));
    }

    /**
     * Closes the channels to the members (not the seed's); a move under way gives up after
     * its current try.
     */
    @Override
    public void close() {
        closed = true;
        synchronized (this) {
            clients.values().forEach(LeveeClient::close);
            clients.clear();
        }
    }
}
