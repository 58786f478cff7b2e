package dev.levee.client;

import static org.junit.jupiter.api.Assertions.assertTrue;

import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import java.util.stream.Stream;
import org.junit.jupiter.api.DynamicTest;
import org.junit.jupiter.api.TestFactory;

/**
 * Every scenario of conformance/scenarios/ against real servers, one dynamic test per file;
 * then every scenario that can run on a cluster ({@link ConformanceRunner#runsOnACluster})
 * against a new three-node cluster that replicates its queues, talking to node 1, 2 and 3 in
 * turn, as the Rust runner (crates/levee/tests/conformance.rs) does.
 */
class ConformanceTest {
    /** Scenarios the Rust runner runs on a cluster: the Java runner must run as many. */
    private static final int ON_A_CLUSTER_AT_LEAST = 13;

    private static List<Path> scenarioPaths() throws Exception {
        Path directory = Repository.root().resolve("conformance/scenarios");
        try (Stream<Path> files = Files.list(directory)) {
            return files.filter(path -> path.toString().endsWith(".json")).sorted().toList();
        }
    }

    private static String name(Path path) {
        return path.getFileName().toString().replace(".json", "");
    }

    @TestFactory
    Stream<DynamicTest> scenarios() throws Exception {
        return scenarioPaths().stream()
                .map(path -> DynamicTest.dynamicTest(name(path), () -> ConformanceRunner.run(path)));
    }

    @TestFactory
    Stream<DynamicTest> given_a_three_node_cluster_then_the_java_client_passes_every_scenario_it_can_run()
            throws Exception {
        List<Path> onACluster = new ArrayList<>();
        for (Path path : scenarioPaths()) {
            if (ConformanceRunner.runsOnACluster(ConformanceRunner.read(path))) {
                onACluster.add(path);
            }
        }
        assertTrue(onACluster.size() >= ON_A_CLUSTER_AT_LEAST, "only " + onACluster + " run on a cluster");
        List<DynamicTest> tests = new ArrayList<>();
        for (int index = 0; index < onACluster.size(); index++) {
            Path path = onACluster.get(index);
            int entry = index % 3;
            tests.add(DynamicTest.dynamicTest(name(path) + " (cluster, through node " + (entry + 1) + ")",
                    () -> ConformanceRunner.runOnACluster(path, entry)));
        }
        return tests.stream();
    }
}
