package dev.levee.client;

import java.nio.file.Files;
import java.nio.file.Path;
import java.util.stream.Stream;
import org.junit.jupiter.api.DynamicTest;
import org.junit.jupiter.api.TestFactory;

/** Every scenario of conformance/scenarios/ against real servers, one dynamic test per file. */
class ConformanceTest {
    @TestFactory
    Stream<DynamicTest> scenarios() throws Exception {
        Path directory = Repository.root().resolve("conformance/scenarios");
        try (Stream<Path> files = Files.list(directory)) {
            return files.filter(path -> path.toString().endsWith(".json")).sorted().toList().stream()
                    .map(path -> DynamicTest.dynamicTest(path.getFileName().toString().replace(".json", ""),
                            () -> ConformanceRunner.run(path)));
        }
    }
}
