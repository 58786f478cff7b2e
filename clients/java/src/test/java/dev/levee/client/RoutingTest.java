package dev.levee.client;

import static org.junit.jupiter.api.Assertions.assertEquals;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import java.nio.file.Files;
import java.util.ArrayList;
import java.util.HexFormat;
import java.util.List;
import org.junit.jupiter.api.Test;

/** The routing hash, rendezvous choice and XXH3 partitions against the Rust code's vectors. */
class RoutingTest {
    private static JsonNode vectors() throws Exception {
        return new ObjectMapper().readTree(Files.readString(
                Repository.root().resolve("conformance/vectors/routing-and-partitions.json")));
    }

    private static List<byte[]> keys(JsonNode vectors) {
        List<byte[]> keys = new ArrayList<>();
        for (JsonNode entry : vectors.get("key_hashes")) {
            keys.add(HexFormat.of().parseHex(entry.get("key_hex").asText()));
        }
        return keys;
    }

    private static long hex64(JsonNode node) {
        return Long.parseUnsignedLong(node.asText(), 16);
    }

    @Test
    void given_vector_keys_when_hashed_should_match_rust_foldhash_and_xxh3() throws Exception {
        JsonNode vectors = vectors();
        int checked = 0;
        for (JsonNode entry : vectors.get("key_hashes")) {
            byte[] key = HexFormat.of().parseHex(entry.get("key_hex").asText());
            assertEquals(hex64(entry.get("hash")), Routing.keyHash(key), "foldhash of " + key.length + " bytes");
            assertEquals(hex64(entry.get("xxh3_64")), Xxh3.hash64(key), "xxh3 of " + key.length + " bytes");
            checked++;
        }
        assertEquals(76, checked);
    }

    @Test
    void given_vector_servers_when_routing_should_choose_as_rust_rendezvous() throws Exception {
        JsonNode vectors = vectors();
        List<byte[]> keys = keys(vectors);
        for (JsonNode route : vectors.get("routes")) {
            int servers = route.get("servers").size();
            long[] seeds = new long[servers];
            for (int i = 0; i < servers; i++) {
                seeds[i] = Routing.serverSeed(route.get("servers").get(i).asText());
                assertEquals(hex64(route.get("seeds").get(i)), seeds[i], "seed of server " + i);
            }
            for (int k = 0; k < keys.size(); k++) {
                long hash = Routing.keyHash(keys.get(k));
                assertEquals(route.get("server_of").get(k).asInt(), Routing.rendezvous(hash, seeds, null));
                JsonNode without = route.get("server_of_without_first").get(k);
                int expected = without.isNull() ? -1 : without.asInt();
                assertEquals(expected, Routing.rendezvous(hash, seeds, index -> index != 0));
            }
        }
    }

    @Test
    void given_vector_partition_counts_when_partitioning_should_match_xxh3_mod_partitions() throws Exception {
        JsonNode vectors = vectors();
        List<byte[]> keys = keys(vectors);
        for (JsonNode entry : vectors.get("partitions")) {
            int partitions = entry.get("partitions").asInt();
            for (int k = 0; k < keys.size(); k++) {
                assertEquals(entry.get("partition_of").get(k).asInt(), Routing.topicPartition(keys.get(k), partitions),
                        "key " + k + " over " + partitions);
            }
        }
    }

    @Test
    void given_the_shard_vectors_when_placing_queues_should_match_the_rust_values() throws Exception {
        JsonNode shards = new ObjectMapper().readTree(Files.readString(
                Repository.root().resolve("conformance/vectors/shards.json")));
        JsonNode names = shards.get("names");
        for (JsonNode entry : shards.get("shard_of")) {
            int count = entry.get("shards").asInt();
            for (int n = 0; n < names.size(); n++) {
                assertEquals(entry.get("shard_of").get(n).asInt(), Routing.shardOf(names.get(n).asText(), count),
                        "name " + n + " over " + count);
                assertEquals(entry.get("shard_of").get(n).asInt(), Routing.shardOf(
                        names.get(n).asText().getBytes(java.nio.charset.StandardCharsets.UTF_8), count),
                        "name " + n + " as bytes over " + count);
            }
        }
        for (JsonNode entry : shards.get("replicas")) {
            long[] voters = new long[entry.get("voters").size()];
            for (int v = 0; v < voters.length; v++) {
                voters[v] = entry.get("voters").get(v).asLong();
            }
            for (int shard = 0; shard < 16; shard++) {
                List<Long> expected = new ArrayList<>();
                for (JsonNode node : entry.get("replicas_of_shards_0_to_15").get(shard)) {
                    expected.add(node.asLong());
                }
                assertEquals(expected, Routing.shardReplicas(shard, voters), "shard " + shard);
            }
        }
    }
}
