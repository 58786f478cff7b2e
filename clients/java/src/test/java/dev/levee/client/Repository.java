package dev.levee.client;

import java.nio.file.Files;
import java.nio.file.Path;
import java.nio.file.Paths;

/** Where the repository root is (the conformance scenarios and vectors live there). */
final class Repository {
    private Repository() {}

    static Path root() {
        String configured = System.getenv("LEVEE_REPO");
        if (configured != null && !configured.isEmpty()) {
            return Paths.get(configured).toAbsolutePath().normalize();
        }
        Path here = Paths.get("").toAbsolutePath();
        for (Path candidate = here; candidate != null; candidate = candidate.getParent()) {
            if (Files.isDirectory(candidate.resolve("conformance/scenarios"))) {
                return candidate;
            }
        }
        throw new IllegalStateException("cannot find the repository root (conformance/) above " + here);
    }
}
