package dev.levee.client;

import com.fasterxml.jackson.databind.ObjectMapper;
import dev.levee.v1.ConsumeResponse;
import dev.levee.v1.Commit;
import dev.levee.v1.CommitResult;
import dev.levee.v1.DescribeGroupResponse;
import dev.levee.v1.ErrorCode;
import dev.levee.v1.GetQueueInfoResponse;
import dev.levee.v1.HotKeyEvent;
import dev.levee.v1.HotKeyRule;
import dev.levee.v1.HotKeySource;
import dev.levee.v1.KeyCount;
import dev.levee.v1.MatchKind;
import dev.levee.v1.PartitionAssignment;
import dev.levee.v1.ReadResponse;
import dev.levee.v1.TopicDelivery;
import java.math.BigDecimal;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.CodingErrorAction;
import java.nio.charset.StandardCharsets;
import java.nio.ByteBuffer;
import java.nio.file.Files;
import java.nio.file.Path;
import java.time.Duration;
import java.util.ArrayDeque;
import java.util.ArrayList;
import java.util.Collections;
import java.util.HashMap;
import java.util.HashSet;
import java.util.HexFormat;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.Objects;
import java.util.Set;
import java.util.TreeMap;
import java.util.concurrent.CompletableFuture;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.CopyOnWriteArrayList;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicInteger;
import java.util.function.BooleanSupplier;

/**
 * Runs one conformance scenario (conformance/scenarios/*.json) against real servers with this
 * client. The format is conformance/README.md's; each case of {@link #operate} is one entry of
 * its vocabulary and returns the result object that the step's expect is matched against (the
 * Python runner, clients/python/tests/conformance_runner.py, implements the same).
 */
final class ConformanceRunner {
    private static final long POLL_MS = 10;
    private static final ObjectMapper JSON = new ObjectMapper();

    private final Map<String, Object> scenario;
    private final List<LeveeServer> servers = new ArrayList<>();
    private final Map<Integer, LeveeClient> clients = new HashMap<>();
    private final Map<String, Object> variables = new HashMap<>();
    private final Map<String, HotKeys<Object>> hotKeys = new HashMap<>();
    private final Map<String, List<Map<String, Object>>> changes = new HashMap<>();
    private final Map<String, Member> members = new HashMap<>();
    private final Map<String, Subscription> subscriptions = new HashMap<>();
    private final Map<String, Mailboxes> many = new HashMap<>();

    /** A raw member stream and what arrived on it. */
    private static final class Member {
        MemberStream stream;
        final ArrayDeque<ConsumeResponse> assignments = new ArrayDeque<>();
        final ArrayDeque<TopicDelivery> deliveries = new ArrayDeque<>();
        final ArrayDeque<List<CommitResult>> commitResults = new ArrayDeque<>();
        volatile LeveeException error;
        volatile boolean ended;
    }

    static final class ScenarioFailure extends AssertionError {
        private static final long serialVersionUID = 1L;

        ScenarioFailure(String message) {
            super(message);
        }
    }

    private ConformanceRunner(Map<String, Object> scenario) {
        this.scenario = scenario;
    }

    /** Shards of the three-node clusters the scenarios also run against. */
    static final int CLUSTER_SHARDS = 4;
    /**
     * Ops a scenario run against a three-node cluster may not use: stopping or restarting its
     * only server (the cluster's other nodes would go on). The Rust runner's rule.
     */
    static final Set<String> NOT_ON_A_CLUSTER = Set.of("stop_server", "start_server", "restart_server");

    /** The cluster's nodes other than the one the scenario talks to (null against lone servers). */
    private List<LeveeServer> otherNodes;

    @SuppressWarnings("unchecked")
    static Map<String, Object> read(Path path) throws Exception {
        return JSON.readValue(Files.readString(path), Map.class);
    }

    static void run(Path path) throws Exception {
        new ConformanceRunner(read(path)).run(-1);
    }

    /**
     * Whether {@code scenario} also runs against a three-node cluster: one server, and no op
     * of {@link #NOT_ON_A_CLUSTER}.
     */
    @SuppressWarnings("unchecked")
    static boolean runsOnACluster(Map<String, Object> scenario) {
        if (((Number) scenario.getOrDefault("servers", 1)).intValue() != 1) {
            return false;
        }
        for (Object step : (List<Object>) scenario.getOrDefault("steps", List.of())) {
            if (NOT_ON_A_CLUSTER.contains(((Map<String, Object>) step).get("op"))) {
                return false;
            }
        }
        return true;
    }

    /**
     * Runs the scenario at {@code path} against a new three-node cluster that replicates its
     * queues ({@link #CLUSTER_SHARDS} shards, each placed on the three nodes and led by its
     * preferred replica before the first step), talking to node {@code entry} + 1 as its only
     * server. The scenario must {@link #runsOnACluster}.
     */
    static void runOnACluster(Path path, int entry) throws Exception {
        Map<String, Object> scenario = read(path);
        if (!runsOnACluster(scenario)) {
            throw new IllegalArgumentException(path + " does not run on a cluster");
        }
        new ConformanceRunner(scenario).run(entry);
    }

    /** Starts the cluster, the scenario's server 0 being node {@code entry} + 1. */
    private void startCluster(int entry) throws Exception {
        List<LeveeServer> nodes = new ArrayList<>();
        otherNodes = new ArrayList<>();
        try {
            ReplicatedCluster.threeNodes(nodes, CLUSTER_SHARDS);
        } finally {
            // Closed with the scenario, started or not.
            otherNodes.addAll(nodes);
        }
        List<LeveeClient> probes = new ArrayList<>();
        try {
            for (LeveeServer node : nodes) {
                probes.add(LeveeClient.connect(node.grpcAddr));
            }
            ReplicatedCluster.waitSettled(probes, CLUSTER_SHARDS);
        } finally {
            probes.forEach(LeveeClient::close);
        }
        otherNodes.remove(nodes.get(entry));
        servers.add(nodes.get(entry));
    }

    /** Runs the steps against lone servers ({@code clusterEntry} -1) or a cluster's node. */
    @SuppressWarnings("unchecked")
    private void run(int clusterEntry) throws Exception {
        int count = ((Number) scenario.getOrDefault("servers", 1)).intValue();
        List<String> extra = (List<String>) scenario.getOrDefault("server_args", List.of());
        try {
            if (clusterEntry >= 0) {
                startCluster(clusterEntry);
            } else {
                for (int index = 0; index < count; index++) {
                    LeveeServer server = new LeveeServer(extra == null ? List.of() : extra);
                    servers.add(server);
                    server.start();
                }
            }
            int number = 0;
            for (Object step : (List<Object>) scenario.get("steps")) {
                step(++number, (Map<String, Object>) step);
            }
        } finally {
            close();
        }
    }

    private void close() {
        hotKeys.values().forEach(HotKeys::close);
        members.values().forEach(member -> member.stream.close());
        subscriptions.values().forEach(Subscription::close);
        many.values().forEach(Mailboxes::close);
        clients.values().forEach(LeveeClient::close);
        List<LeveeServer> processes = new ArrayList<>(servers);
        if (otherNodes != null) {
            processes.addAll(otherNodes);
        }
        for (LeveeServer server : processes) {
            try {
                server.close();
            } catch (Exception ignored) {
                // best effort
            }
        }
    }

    // ---- steps, values and matching

    @SuppressWarnings("unchecked")
    private Object resolve(Object value) {
        if (value instanceof Map) {
            Map<String, Object> map = (Map<String, Object>) value;
            if (map.size() == 1 && map.containsKey("$var")) {
                return variables.get((String) map.get("$var"));
            }
            Map<String, Object> resolved = new LinkedHashMap<>();
            map.forEach((key, item) -> resolved.put(key, resolve(item)));
            return resolved;
        }
        if (value instanceof List) {
            List<Object> resolved = new ArrayList<>();
            for (Object item : (List<Object>) value) {
                resolved.add(resolve(item));
            }
            return resolved;
        }
        return value;
    }

    @SuppressWarnings("unchecked")
    private void step(int number, Map<String, Object> step) throws Exception {
        String op = (String) step.get("op");
        Map<String, Object> args = (Map<String, Object>) resolve(step.getOrDefault("args", Map.of()));
        Object expect = resolve(step.getOrDefault("expect", Map.of()));
        Map<String, Object> result;
        try {
            result = operate(op, new Args(args));
        } catch (LeveeException error) {
            if (error.getClass() != LeveeException.classOf(error.code())) {
                throw new ScenarioFailure("step " + number + " (" + op + "): " + error + " is not the typed error of its code");
            }
            result = new LinkedHashMap<>();
            result.put("error", error.reason());
            result.put("code", error.codeNumber());
            result.put("message", error.description());
        }
        boolean expectsError = expect instanceof Map && ((Map<String, Object>) expect).containsKey("error");
        if (!expectsError && result.containsKey("error")) {
            throw new ScenarioFailure("step " + number + " (" + op + "): unexpected error " + result);
        }
        String problem = matches(expect, result, "result");
        if (problem != null) {
            throw new ScenarioFailure("step " + number + " (" + op + " " + abbreviate(JSON.writeValueAsString(args)) + "): "
                    + problem + "; result " + abbreviate(JSON.writeValueAsString(result)));
        }
        Map<String, Object> save = (Map<String, Object>) step.getOrDefault("save", Map.of());
        for (Map.Entry<String, Object> entry : save.entrySet()) {
            variables.put(entry.getKey(), lookup(result, (String) entry.getValue()));
        }
    }

    private static String abbreviate(String text) {
        return text.length() > 300 ? text.substring(0, 300) + "..." : text;
    }

    @SuppressWarnings("unchecked")
    private static Object lookup(Object result, String path) {
        for (String part : path.split("\\.")) {
            result = result instanceof List ? ((List<Object>) result).get(Integer.parseInt(part))
                    : ((Map<String, Object>) result).get(part);
        }
        return result;
    }

    private static boolean equal(Object expected, Object actual) {
        if (expected instanceof Number && actual instanceof Number) {
            return new BigDecimal(expected.toString()).compareTo(new BigDecimal(actual.toString())) == 0;
        }
        if (expected instanceof Map && actual instanceof Map || expected instanceof List && actual instanceof List) {
            return matches(expected, actual, "") == null && matches(actual, expected, "") == null;
        }
        return Objects.equals(expected, actual);
    }

    private static int compare(Object actual, Object operand) {
        return new BigDecimal(actual.toString()).compareTo(new BigDecimal(operand.toString()));
    }

    /** Null when {@code actual} meets {@code expected}, else why not. */
    @SuppressWarnings("unchecked")
    static String matches(Object expected, Object actual, String path) {
        if (expected instanceof Map && ((Map<String, Object>) expected).size() == 1) {
            Map.Entry<String, Object> only = ((Map<String, Object>) expected).entrySet().iterator().next();
            Object operand = only.getValue();
            switch (only.getKey()) {
                case "at_least":
                    return actual instanceof Number && compare(actual, operand) >= 0 ? null
                            : path + ": " + actual + " is below " + operand;
                case "at_most":
                    return actual instanceof Number && compare(actual, operand) <= 0 ? null
                            : path + ": " + actual + " is above " + operand;
                case "contains":
                case "not_contains": {
                    boolean has;
                    if (actual instanceof String) {
                        has = ((String) actual).contains((String) operand);
                    } else {
                        has = ((List<Object>) actual).stream().anyMatch(item -> equal(operand, item));
                    }
                    boolean wanted = only.getKey().equals("contains");
                    return has == wanted ? null : path + ": " + actual + (wanted ? " lacks " : " has ") + operand;
                }
                case "length": {
                    int length = actual instanceof String ? ((String) actual).length() : ((List<Object>) actual).size();
                    return length == ((Number) operand).intValue() ? null : path + ": length " + length + ", not " + operand;
                }
                case "unordered": {
                    if (!(actual instanceof List) || ((List<Object>) actual).size() != ((List<Object>) operand).size()) {
                        return path + ": " + actual + " is not " + operand + " in some order";
                    }
                    List<Object> left = new ArrayList<>((List<Object>) actual);
                    for (Object want : (List<Object>) operand) {
                        int found = -1;
                        for (int i = 0; i < left.size(); i++) {
                            if (equal(want, left.get(i))) {
                                found = i;
                                break;
                            }
                        }
                        if (found < 0) {
                            return path + ": " + actual + " is not " + operand + " in some order";
                        }
                        left.remove(found);
                    }
                    return null;
                }
                default:
                    break;
            }
        }
        if (expected instanceof Map && actual instanceof Map) {
            for (Map.Entry<String, Object> entry : ((Map<String, Object>) expected).entrySet()) {
                Map<String, Object> actualMap = (Map<String, Object>) actual;
                if (!actualMap.containsKey(entry.getKey())) {
                    return path + "." + entry.getKey() + ": missing from " + actual;
                }
                String problem = matches(entry.getValue(), actualMap.get(entry.getKey()), path + "." + entry.getKey());
                if (problem != null) {
                    return problem;
                }
            }
            return null;
        }
        if (expected instanceof List && actual instanceof List) {
            List<Object> want = (List<Object>) expected;
            List<Object> got = (List<Object>) actual;
            if (want.size() != got.size()) {
                return path + ": expected " + expected + ", got " + actual;
            }
            for (int i = 0; i < want.size(); i++) {
                String problem = matches(want.get(i), got.get(i), path + "[" + i + "]");
                if (problem != null) {
                    return problem;
                }
            }
            return null;
        }
        return equal(expected, actual) ? null : path + ": expected " + expected + ", got " + actual;
    }

    /** A scenario's bytes: text as UTF-8, {"hex": ...}, or {"repeat": s, "times": n}. */
    @SuppressWarnings("unchecked")
    static byte[] toBytes(Object value) {
        if (value instanceof String) {
            return ((String) value).getBytes(StandardCharsets.UTF_8);
        }
        if (value instanceof Map && ((Map<String, Object>) value).containsKey("hex")) {
            return HexFormat.of().parseHex((String) ((Map<String, Object>) value).get("hex"));
        }
        if (value instanceof Map && ((Map<String, Object>) value).containsKey("repeat")) {
            Map<String, Object> map = (Map<String, Object>) value;
            return ((String) map.get("repeat")).repeat(((Number) map.get("times")).intValue()).getBytes(StandardCharsets.UTF_8);
        }
        throw new ScenarioFailure("not a bytes value: " + value);
    }

    /** Bytes in a result: text when printable UTF-8, else {"hex": ...}. */
    static Object fromBytes(byte[] value) {
        try {
            String text = StandardCharsets.UTF_8.newDecoder().onMalformedInput(CodingErrorAction.REPORT)
                    .onUnmappableCharacter(CodingErrorAction.REPORT).decode(ByteBuffer.wrap(value)).toString();
            boolean printable = text.codePoints().allMatch(point -> !Character.isISOControl(point)
                    && Character.getType(point) != Character.UNASSIGNED && (point == ' ' || !Character.isWhitespace(point)));
            if (printable) {
                return text;
            }
        } catch (CharacterCodingException notText) {
            // hex below
        }
        return Map.of("hex", HexFormat.of().formatHex(value));
    }

    private static List<Object> fromBytesList(List<byte[]> values) {
        List<Object> out = new ArrayList<>();
        for (byte[] value : values) {
            out.add(fromBytes(value));
        }
        return out;
    }

    /** A step's arguments with defaults. */
    private static final class Args {
        final Map<String, Object> values;

        Args(Map<String, Object> values) {
            this.values = values;
        }

        boolean has(String name) {
            return values.containsKey(name) && values.get(name) != null;
        }

        Object get(String name) {
            if (!values.containsKey(name)) {
                throw new ScenarioFailure("missing argument '" + name + "'");
            }
            return values.get(name);
        }

        String string(String name, String fallback) {
            return has(name) ? (String) values.get(name) : fallback;
        }

        String string(String name) {
            return (String) get(name);
        }

        long number(String name, long fallback) {
            return has(name) ? ((Number) values.get(name)).longValue() : fallback;
        }

        long number(String name) {
            return ((Number) get(name)).longValue();
        }

        int integer(String name, int fallback) {
            return (int) number(name, fallback);
        }

        boolean flag(String name, boolean fallback) {
            return has(name) ? (Boolean) values.get(name) : fallback;
        }

        byte[] bytes(String name, String fallback) {
            return has(name) ? toBytes(values.get(name)) : fallback.getBytes(StandardCharsets.UTF_8);
        }

        byte[] bytes(String name) {
            return toBytes(get(name));
        }

        @SuppressWarnings("unchecked")
        List<Object> list(String name) {
            return (List<Object>) get(name);
        }

        int server() {
            return integer("server", 0);
        }
    }

    private static Map<String, Object> result(Object... pairs) {
        Map<String, Object> out = new LinkedHashMap<>();
        for (int i = 0; i < pairs.length; i += 2) {
            out.put((String) pairs[i], pairs[i + 1]);
        }
        return out;
    }

    private LeveeClient client(int server) {
        return clients.computeIfAbsent(server, index -> LeveeClient.connect(servers.get(index).grpcAddr,
                ClientOptions.defaults().requestTimeout(Duration.ofSeconds(20))));
    }

    /**
     * Waits (at most 1 s) until {@code session}'s change listeners saw {@code key} turn
     * {@code hot}: the hot set changes a moment before the listeners run, and an app sees both.
     */
    private void awaitChange(String session, byte[] key, boolean hot) throws InterruptedException {
        Object wanted = fromBytes(key);
        List<Map<String, Object>> observed = changes.get(session);
        until(() -> observed.stream().anyMatch(change -> java.util.Objects.equals(wanted, change.get("key"))
                && Boolean.valueOf(hot).equals(change.get("hot"))), 1_000);
    }
    private static boolean until(BooleanSupplier condition, long withinMs) throws InterruptedException {
        long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(withinMs);
        while (true) {
            if (condition.getAsBoolean()) {
                return true;
            }
            if (System.nanoTime() - deadline >= 0) {
                return false;
            }
            Thread.sleep(POLL_MS);
        }
    }

    private static final Map<String, MatchKind> MATCH_KINDS = Map.of("exact", MatchKind.MATCH_KIND_EXACT, "prefix",
            MatchKind.MATCH_KIND_PREFIX, "default", MatchKind.MATCH_KIND_DEFAULT);

    private static String matchName(MatchKind kind) {
        for (Map.Entry<String, MatchKind> entry : MATCH_KINDS.entrySet()) {
            if (entry.getValue() == kind) {
                return entry.getKey();
            }
        }
        return "unspecified";
    }

    private static String sourceName(HotKeySource source) {
        switch (source) {
            case HOT_KEY_SOURCE_DETECTED: return "DETECTED";
            case HOT_KEY_SOURCE_MANUAL: return "MANUAL";
            default: return "UNSPECIFIED";
        }
    }

    // ---- the operations

    @SuppressWarnings("unchecked")
    private Map<String, Object> operate(String op, Args a) throws Exception {
        switch (op) {
            // servers and admin
            case "server_info": {
                var info = client(a.server()).serverInfo();
                return result("version", info.getVersion(), "grpc_addr", info.getGrpcAddr());
            }
            case "stop_server":
                servers.get(a.server()).stop();
                return result();
            case "start_server":
                servers.get(a.server()).start(servers.get(a.server()).grpcAddr);
                return result();
            case "restart_server":
                servers.get(a.server()).restart();
                return result();
            case "echo": {
                LeveeClient client = client(a.server());
                long timeoutMs = a.number("timeout_ms", 0);
                if (timeoutMs > 0) {
                    client = client.withRequestTimeout(Duration.ofMillis(timeoutMs));
                }
                return result("payload", fromBytes(client.echo(a.bytes("payload", ""), a.integer("delay_ms", 0))));
            }
            case "sleep":
                Thread.sleep(a.number("ms"));
                return result();
            // hot keys: admin
            case "set_rules": {
                List<HotKeyRule> rules = new ArrayList<>();
                for (Object item : a.list("rules")) {
                    Map<String, Object> rule = (Map<String, Object>) item;
                    rules.add(HotKeyRule.newBuilder().setMatchKind(MATCH_KINDS.get((String) rule.get("match")))
                            .setKey(com.google.protobuf.ByteString.copyFrom(toBytes(rule.getOrDefault("key", ""))))
                            .setWindowMs(((Number) rule.get("window_ms")).intValue())
                            .setThreshold(((Number) rule.get("threshold")).longValue())
                            .setHotDurationMs(((Number) rule.get("hot_duration_ms")).longValue())
                            .setDescription((String) rule.getOrDefault("description", "")).build());
                }
                client(a.server()).setHotKeyRules(a.string("app"), rules);
                return result();
            }
            case "get_rules": {
                List<Object> rules = new ArrayList<>();
                for (HotKeyRule rule : client(a.server()).hotKeyRules(a.string("app"))) {
                    rules.add(result("match", matchName(rule.getMatchKind()), "key", fromBytes(rule.getKey().toByteArray()),
                            "window_ms", rule.getWindowMs(), "threshold", rule.getThreshold(), "hot_duration_ms",
                            rule.getHotDurationMs(), "description", rule.getDescription()));
                }
                return result("rules", rules);
            }
            case "set_hot_key":
                client(a.server()).setHotKey(a.string("app"), a.bytes("key"), a.number("duration_ms"));
                return result();
            case "remove_hot_key":
                return result("was_hot", client(a.server()).removeHotKey(a.string("app"), a.bytes("key")));
            case "list_hot_keys": {
                List<Object> keys = new ArrayList<>();
                List<Object> sources = new ArrayList<>();
                for (HotKeyEvent event : client(a.server()).hotKeys(a.string("app"))) {
                    keys.add(fromBytes(event.getKey().toByteArray()));
                    sources.add(sourceName(event.getSource()));
                }
                return result("keys", keys, "sources", sources);
            }
            case "top_keys": {
                List<Object> keys = new ArrayList<>();
                List<Object> counts = new ArrayList<>();
                for (KeyCount count : client(a.server()).topKeys(a.string("app"), a.integer("limit", 10))) {
                    keys.add(fromBytes(count.getKey().toByteArray()));
                    counts.add(count.getCount());
                }
                return result("keys", keys, "counts", counts);
            }
            // hot keys: the app-server client
            case "hotkeys_open": {
                List<Object> indexes = a.has("servers") ? a.list("servers") : List.of(0);
                List<String> addresses = new ArrayList<>();
                for (Object index : indexes) {
                    addresses.add(servers.get(((Number) index).intValue()).grpcAddr);
                }
                // The scenarios' servers are lone servers, each its own cluster: the list as given.
                HotKeys<Object> session = HotKeys.start(new HotKeysOptions(a.string("app"), addresses)
                        .followCluster(false)
                        .reportInterval(Duration.ofMillis(a.number("report_interval_ms", 20)))
                        .reconnectBackoff(Duration.ofMillis(50), Duration.ofMillis(500)));
                String name = a.string("session");
                hotKeys.put(name, session);
                List<Map<String, Object>> observed = new CopyOnWriteArrayList<>();
                changes.put(name, observed);
                session.onChange(change -> observed.add(result("key", fromBytes(change.key()), "hot", change.hot(),
                        "manual", change.manual())));
                boolean connected = until(() -> session.stats().serversConnected() == addresses.size(), 10_000);
                return result("connected", connected);
            }
            case "hotkeys_close":
                hotKeys.remove(a.string("session")).close();
                return result();
            case "access": {
                HotKeys<Object> session = hotKeys.get(a.string("session"));
                byte[] key = a.bytes("key");
                boolean hot = false;
                long times = a.number("times", 1);
                for (long i = 0; i < times; i++) {
                    hot = session.isHot(key);
                }
                return result("hot", hot);
            }
            case "flush":
                hotKeys.get(a.string("session")).flush();
                return result();
            case "is_hot":
                return result("hot", hotKeys.get(a.string("session")).isHotNow(a.bytes("key")));
            case "await_hot": {
                HotKeys<Object> session = hotKeys.get(a.string("session"));
                byte[] key = a.bytes("key");
                boolean hot = until(() -> session.isHotNow(key), a.number("within_ms"));
                if (hot) {
                    awaitChange(a.string("session"), key, true);
                }
                return result("hot", hot);
            }
            case "await_cool": {
                HotKeys<Object> session = hotKeys.get(a.string("session"));
                byte[] key = a.bytes("key");
                boolean cooled = until(() -> !session.isHotNow(key), a.number("within_ms"));
                if (cooled) {
                    awaitChange(a.string("session"), key, false);
                }
                return result("hot", !cooled);
            }
            case "await_connected": {
                HotKeys<Object> session = hotKeys.get(a.string("session"));
                long count = a.number("servers");
                return result("connected", until(() -> session.stats().serversConnected() == count, a.number("within_ms")));
            }
            case "changes":
                return result("changes", new ArrayList<>(changes.get(a.string("session"))));
            case "hotkeys_stats": {
                HotKeysStats stats = hotKeys.get(a.string("session")).stats();
                return result("keys_reported", stats.keysReported(), "keys_unsent", stats.keysUnsent(), "batches_unsent",
                        stats.batchesUnsent(), "sessions_opened", stats.sessionsOpened(), "servers_connected",
                        stats.serversConnected(), "events_received", stats.eventsReceived(), "accesses_recorded",
                        stats.accessesRecorded(), "accesses_dropped", stats.accessesDropped(), "callback_errors",
                        stats.callbackErrors());
            }
            case "server_of":
                return result("server", hotKeys.get(a.string("session")).serverOf(a.bytes("key")));
            // queues
            case "append": {
                List<QueueMessage> messages = new ArrayList<>();
                if (a.has("messages")) {
                    for (Object item : a.list("messages")) {
                        Map<String, Object> message = (Map<String, Object>) item;
                        messages.add(new QueueMessage(toBytes(message.get("queue")), toBytes(message.get("payload")),
                                ((Number) message.getOrDefault("sequence", 0)).longValue()));
                    }
                } else {
                    List<Object> payloads = a.has("payloads") ? a.list("payloads") : List.of();
                    List<Object> sequences = a.has("sequences") ? a.list("sequences") : List.of();
                    for (int i = 0; i < payloads.size(); i++) {
                        long sequence = i < sequences.size() ? ((Number) sequences.get(i)).longValue() : 0;
                        messages.add(new QueueMessage(a.bytes("queue"), toBytes(payloads.get(i)), sequence));
                    }
                }
                LeveeClient client = client(a.server());
                String producerName = a.string("producer_name", "");
                if (!producerName.isEmpty()) {
                    client = client.withProducerName(producerName);
                }
                return result("offsets", client.appendMessages(messages, a.string("producer_id", "")));
            }
            case "read": {
                ReadResponse response = client(a.server()).read(a.bytes("queue"), a.number("offset", 0),
                        a.integer("max_messages", 0), 0);
                List<byte[]> payloads = new ArrayList<>();
                response.getPayloadsList().forEach(payload -> payloads.add(payload.toByteArray()));
                return result("payloads", fromBytesList(payloads), "first_offset", response.getFirstOffset(),
                        "next_offset", response.getNextOffset(), "queue_next_offset", response.getQueueNextOffset());
            }
            case "queue_info": {
                GetQueueInfoResponse info = client(a.server()).queueInfo(a.bytes("queue"));
                return result("first_offset", info.getFirstOffset(), "next_offset", info.getNextOffset());
            }
            case "delete_queue":
                return result("existed", client(a.server()).deleteQueue(a.bytes("queue")));
            case "set_producer_rate":
                client(a.server()).setProducerRate(a.string("producer_name"),
                        ((Number) a.get("messages_per_s")).doubleValue());
                return result();
            case "produce":
                return produce(a);
            // topics and groups
            case "create_topic":
                return result("existed", client(a.server()).createTopic(a.string("topic"), a.integer("partitions", 0)));
            case "partition_of":
                return result("partition", Routing.topicPartition(a.bytes("key"), a.integer("partitions", 0)));
            case "publish": {
                List<PublishRecord> records = new ArrayList<>();
                for (Object item : a.list("messages")) {
                    Map<String, Object> message = (Map<String, Object>) item;
                    Object partition = message.get("partition");
                    records.add(new PublishRecord(toBytes(message.getOrDefault("key", "")),
                            toBytes(message.getOrDefault("payload", "")),
                            partition == null ? -1 : ((Number) partition).intValue(),
                            ((Number) message.getOrDefault("sequence", 0)).longValue(),
                            ((Number) message.getOrDefault("delay_ms", 0)).longValue()));
                }
                List<Object> partitions = new ArrayList<>();
                List<Object> offsets = new ArrayList<>();
                for (Published published : client(a.server()).publish(a.string("topic"), records, a.string("producer_id", ""))) {
                    partitions.add(published.partition());
                    offsets.add(published.offset());
                }
                return result("partitions", partitions, "offsets", offsets);
            }
            case "describe_topic": {
                List<Object> next = new ArrayList<>();
                client(a.server()).describeTopic(a.string("topic")).getPartitionsList()
                        .forEach(partition -> next.add(partition.getNextOffset()));
                return result("next_offsets", next);
            }
            case "describe_group": {
                DescribeGroupResponse described = client(a.server()).describeGroup(a.string("group"), a.string("topic"));
                List<String> memberIds = new ArrayList<>();
                described.getMembersList().forEach(member -> memberIds.add(member.getMember()));
                Collections.sort(memberIds);
                List<Object> owners = new ArrayList<>();
                List<Object> epochs = new ArrayList<>();
                List<Object> committed = new ArrayList<>();
                described.getPartitionsList().forEach(partition -> {
                    owners.add(partition.getOwner());
                    epochs.add(partition.getEpoch());
                    committed.add(partition.getCommittedOffset());
                });
                return result("generation", described.getGeneration(), "members", memberIds, "owners", owners,
                        "epochs", epochs, "committed", committed);
            }
            case "member_join":
                return memberJoin(a);
            case "member_await_assignment":
                return memberAwaitAssignment(a.string("member"), a.number("within_ms", 5000));
            case "member_receive": {
                Member member = members.get(a.string("member"));
                int count = a.integer("count", 0);
                until(() -> {
                    synchronized (member) {
                        return member.deliveries.size() >= count || member.ended;
                    }
                }, a.number("within_ms", 5000));
                List<Object> partitions = new ArrayList<>();
                List<Object> offsets = new ArrayList<>();
                List<Object> epochs = new ArrayList<>();
                List<Object> payloads = new ArrayList<>();
                synchronized (member) {
                    for (int i = 0; i < count && !member.deliveries.isEmpty(); i++) {
                        TopicDelivery delivery = member.deliveries.poll();
                        partitions.add(delivery.getPartition());
                        offsets.add(delivery.getOffset());
                        epochs.add(delivery.getEpoch());
                        payloads.add(fromBytes(delivery.getPayload().toByteArray()));
                    }
                }
                return result("partitions", partitions, "offsets", offsets, "epochs", epochs, "payloads", payloads);
            }
            case "member_commit": {
                Member member = members.get(a.string("member"));
                List<Commit> commits = new ArrayList<>();
                for (Object item : a.list("commits")) {
                    Map<String, Object> commit = (Map<String, Object>) item;
                    commits.add(Commit.newBuilder().setPartition(((Number) commit.get("partition")).intValue())
                            .setEpoch(((Number) commit.get("epoch")).longValue())
                            .setNextOffset(((Number) commit.get("next_offset")).longValue()).build());
                }
                member.stream.commit(commits);
                until(() -> {
                    synchronized (member) {
                        return !member.commitResults.isEmpty() || member.ended;
                    }
                }, a.number("within_ms", 5000));
                List<CommitResult> results;
                synchronized (member) {
                    results = member.commitResults.poll();
                }
                if (results == null) {
                    if (member.error != null) {
                        throw member.error;
                    }
                    throw new ScenarioFailure("member " + a.string("member") + ": no commit answer");
                }
                List<Object> codes = new ArrayList<>();
                List<Object> next = new ArrayList<>();
                for (CommitResult commitResult : results) {
                    codes.add(commitResult.getCodeValue() == 0 ? "OK" : LeveeException.reasonOf(commitResult.getCode()));
                    next.add(commitResult.getNextOffset());
                }
                return result("codes", codes, "next_offsets", next);
            }
            case "member_heartbeat":
                members.get(a.string("member")).stream.heartbeat();
                return result();
            case "member_leave": {
                // This side closes; once the server ended the stream the member has left.
                Member member = members.remove(a.string("member"));
                member.stream.leave();
                until(() -> member.ended, 5000);
                if (!member.ended) {
                    member.stream.close();
                    throw new ScenarioFailure("the server did not end a left member's stream in 5 s");
                }
                return result();
            }
            case "member_status": {
                Member member = members.get(a.string("member"));
                LeveeException error = member.error;
                return error != null ? result("error", error.reason()) : result("open", true);
            }
            case "group_consume":
                return groupConsume(a);
            // mailboxes
            case "subscribe": {
                Subscription subscription = client(a.server()).subscribe(a.bytes("queue"), a.string("consumer"),
                        a.integer("credit", 100));
                subscriptions.put(a.string("subscription"), subscription);
                return result("start_offset", subscription.startOffset());
            }
            case "receive": {
                Subscription subscription = subscriptions.get(a.string("subscription"));
                long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(a.number("within_ms", 5000));
                List<Object> offsets = new ArrayList<>();
                List<Object> payloads = new ArrayList<>();
                int count = a.integer("count", 0);
                while (offsets.size() < count) {
                    Delivery delivery = subscription.next(Duration.ofNanos(Math.max(deadline - System.nanoTime(), 0)));
                    if (delivery == null) {
                        break;
                    }
                    offsets.add(delivery.offset());
                    payloads.add(fromBytes(delivery.payload()));
                }
                return result("offsets", offsets, "payloads", payloads);
            }
            case "ack":
                subscriptions.get(a.string("subscription")).ack(a.number("offset"));
                return result();
            case "unsubscribe":
                subscriptions.remove(a.string("subscription")).close();
                return result();
            case "mailboxes_open":
                many.put(a.string("stream"), client(a.server()).subscribeMany(a.string("consumer"), a.integer("credit", 1000)));
                return result();
            case "mailboxes_add": {
                List<byte[]> queues = new ArrayList<>();
                a.list("queues").forEach(queue -> queues.add(toBytes(queue)));
                return result("mailboxes", many.get(a.string("stream")).add(queues));
            }
            case "mailboxes_receive": {
                Mailboxes mailboxes = many.get(a.string("stream"));
                long deadline = System.nanoTime() + TimeUnit.MILLISECONDS.toNanos(a.number("within_ms", 5000));
                List<Object> deliveries = new ArrayList<>();
                int count = a.integer("count", 0);
                while (deliveries.size() < count) {
                    MailboxDelivery delivery = mailboxes.next(Duration.ofNanos(Math.max(deadline - System.nanoTime(), 0)));
                    if (delivery == null) {
                        break;
                    }
                    deliveries.add(result("mailbox", delivery.mailbox(), "offset", delivery.offset(), "payload",
                            fromBytes(delivery.payload())));
                }
                return result("deliveries", deliveries);
            }
            case "mailboxes_ack": {
                Mailboxes mailboxes = many.get(a.string("stream"));
                for (Object item : a.list("acks")) {
                    Map<String, Object> ack = (Map<String, Object>) item;
                    mailboxes.ack(((Number) ack.get("mailbox")).intValue(), ((Number) ack.get("offset")).longValue());
                }
                mailboxes.flushAcks();
                return result();
            }
            case "mailboxes_close":
                many.remove(a.string("stream")).close();
                return result();
            default:
                throw new ScenarioFailure("unknown op '" + op + "'");
        }
    }

    private Map<String, Object> produce(Args a) {
        int count = a.integer("count", 0);
        byte[] queue = a.bytes("queue");
        Producer producer = new Producer(client(a.server()), ProducerOptions.defaults().idempotent(a.flag("idempotent", false)));
        List<CompletableFuture<Long>> answers = new ArrayList<>();
        try {
            for (int i = 0; i < count; i++) {
                answers.add(producer.send(queue, Integer.toString(i).getBytes(StandardCharsets.UTF_8)));
            }
        } finally {
            producer.close();
        }
        Set<Long> offsets = new HashSet<>();
        for (CompletableFuture<Long> answer : answers) {
            try {
                offsets.add(answer.join());
            } catch (RuntimeException failed) {
                // counted in messages_failed
            }
        }
        long first = offsets.stream().mapToLong(Long::longValue).min().orElse(-1);
        long last = offsets.stream().mapToLong(Long::longValue).max().orElse(-1);
        return result("offsets_distinct", offsets.size() == count, "first_offset", first, "last_offset", last,
                "messages_failed", producer.stats().messagesFailed());
    }

    private Map<String, Object> memberJoin(Args a) throws Exception {
        String name = a.string("member");
        Member member = new Member();
        member.stream = MemberStream.open(client(a.server()), a.string("topic"), a.string("group"), name,
                a.integer("credit", 1000), a.integer("lease_ms", 10_000), new MemberStream.Listener() {
                    @Override
                    public void onResponse(ConsumeResponse response) {
                        synchronized (member) {
                            if (response.hasAssignment()) {
                                member.assignments.add(response);
                            }
                            member.deliveries.addAll(response.getDeliveriesList());
                            if (response.getCommitResultsCount() > 0) {
                                member.commitResults.add(response.getCommitResultsList());
                            }
                        }
                    }

                    @Override
                    public void onEnd(LeveeException error) {
                        member.error = error != null ? error
                                : LeveeException.of(ErrorCode.ERROR_CODE_UNAVAILABLE, "the consume stream closed");
                        member.ended = true;
                    }
                });
        members.put(name, member);
        return memberAwaitAssignment(name, a.number("within_ms", 5000));
    }

    private Map<String, Object> memberAwaitAssignment(String name, long withinMs) throws Exception {
        Member member = members.get(name);
        until(() -> {
            synchronized (member) {
                return !member.assignments.isEmpty() || member.ended;
            }
        }, withinMs);
        ConsumeResponse latest = null;
        synchronized (member) {
            while (!member.assignments.isEmpty()) {
                latest = member.assignments.poll(); // only the latest counts
            }
        }
        if (latest == null) {
            if (member.error != null) {
                throw member.error;
            }
            throw new ScenarioFailure("member " + name + ": no assignment");
        }
        List<Object> partitions = new ArrayList<>();
        List<Object> epochs = new ArrayList<>();
        List<Object> starts = new ArrayList<>();
        for (PartitionAssignment assigned : latest.getAssignment().getPartitionsList()) {
            partitions.add(assigned.getPartition());
            epochs.add(assigned.getEpoch());
            starts.add(assigned.getStartOffset());
        }
        return result("generation", latest.getAssignment().getGeneration(), "partitions", partitions, "epochs", epochs,
                "start_offsets", starts);
    }

    /**
     * The client's GroupConsumer until {@code count} messages are handled; handlers of even
     * offsets sleep longer than odd ones, so completions come out of order.
     */
    private Map<String, Object> groupConsume(Args a) throws Exception {
        int count = a.integer("count", 0);
        int parallelism = a.integer("parallelism", 4);
        ConsumerOptions options = ConsumerOptions.defaults().parallelism(parallelism).ordered(a.flag("ordered", true))
                .commitInterval(Duration.ofMillis(20));
        if (a.has("member")) {
            options.member(a.string("member"));
        }
        GroupConsumer consumer = new GroupConsumer(client(a.server()), a.string("topic"), a.string("group"), options);
        Map<Integer, List<Long>> seen = new ConcurrentHashMap<>();
        AtomicInteger running = new AtomicInteger();
        AtomicInteger mostRunning = new AtomicInteger();
        AtomicInteger total = new AtomicInteger();
        CompletableFuture<ConsumerStats> done = CompletableFuture.supplyAsync(() -> consumer.run(message -> {
            mostRunning.accumulateAndGet(running.incrementAndGet(), Math::max);
            Thread.sleep(message.offset() % 2 == 0 ? 4 : 1);
            seen.computeIfAbsent(message.partition(), partition -> Collections.synchronizedList(new ArrayList<>()))
                    .add(message.offset());
            running.decrementAndGet();
            if (total.incrementAndGet() >= count) {
                consumer.stop();
            }
        }));
        ConsumerStats stats;
        try {
            stats = done.get(a.number("within_ms", 20_000), TimeUnit.MILLISECONDS);
        } catch (java.util.concurrent.TimeoutException late) {
            consumer.stop();
            throw new ScenarioFailure("group_consume: " + total.get() + " of " + count + " handled in time");
        } catch (java.util.concurrent.ExecutionException failed) {
            throw WireErrors.from(failed.getCause());
        }
        boolean inOrder = true;
        for (List<Long> offsets : seen.values()) {
            List<Long> sorted = new ArrayList<>(offsets);
            Collections.sort(sorted);
            inOrder &= sorted.equals(offsets);
        }
        return result("handled", stats.handled(), "ordered_per_partition", inOrder,
                "most_running_at_most_parallelism", mostRunning.get() <= parallelism, "fenced_commits", stats.fencedCommits());
    }

}
