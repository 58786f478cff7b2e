//! Hot-key rules in JSON: the form the admin HTTP API speaks, and the file in the data dir in
//! which versions before the cluster kept rules (`hotkey-rules.json`). Rules are now replicated
//! by the metadata group; a server that finds the file imports it once, then removes it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use levee_hotkey::Rule;
use serde::{Deserialize, Serialize};

use levee_proto::json::RuleRecord;

use super::convert::rule_from_record;

/// The rules file's name inside the data dir.
pub const RULES_FILE_NAME: &str = "hotkey-rules.json";
/// The rules file's format version.
pub const RULES_FORMAT_VERSION: u32 = 1;

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RulesDocument {
    format_version: u32,
    apps: BTreeMap<String, Vec<RuleRecord>>,
}

/// Why the rules file could not be read or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RulesFileError {
    /// Reading or writing failed.
    #[error("hot-key rules file {path}: {operation} failed: {source}", path = path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// `read`, `write`, `fsync`, `rename`.
        operation: &'static str,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not what this version writes.
    #[error(
        "hot-key rules file {path} is not valid: {message}; fix it, or move it away to start \
         with no rules",
        path = path.display()
    )]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// Reads every app's rules; a missing file means no rules.
pub fn load(data_dir: &Path) -> Result<BTreeMap<String, Vec<Rule>>, RulesFileError> {
    let path = data_dir.join(RULES_FILE_NAME);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(source) => {
            return Err(RulesFileError::Io {
                path,
                operation: "read",
                source,
            });
        }
    };
    let invalid = |message: String| RulesFileError::Invalid {
        path: path.clone(),
        message,
    };
    let document: RulesDocument =
        serde_json::from_str(&text).map_err(|error| invalid(error.to_string()))?;
    if document.format_version != RULES_FORMAT_VERSION {
        return Err(invalid(format!(
            "format_version {} is not {RULES_FORMAT_VERSION}, the one this levee reads",
            document.format_version
        )));
    }
    document
        .apps
        .into_iter()
        .map(|(app, records)| {
            let rules = records
                .iter()
                .map(rule_from_record)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|message| invalid(format!("app '{app}': {message}")))?;
            Ok((app, rules))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::fs::{File, OpenOptions};
    use std::io::Write;

    use super::super::convert::rule_to_record;

    use levee_hotkey::RuleMatch;

    use super::*;

    /// Replaces the file with `apps`: write a temporary file, fsync it, rename it over the old one,
    /// fsync the directory. Versions before the cluster kept rules so; the tests make such files.
    fn save(data_dir: &Path, apps: &BTreeMap<String, Vec<Rule>>) -> Result<(), RulesFileError> {
        let path = data_dir.join(RULES_FILE_NAME);
        let temporary = data_dir.join(format!("{RULES_FILE_NAME}.tmp"));
        let document = RulesDocument {
            format_version: RULES_FORMAT_VERSION,
            apps: apps
                .iter()
                .map(|(app, rules)| (app.clone(), rules.iter().map(rule_to_record).collect()))
                .collect(),
        };
        let io = |operation, source| RulesFileError::Io {
            path: path.clone(),
            operation,
            source,
        };
        let text = serde_json::to_vec_pretty(&document)
            .map_err(|error| io("write", std::io::Error::other(error)))?;
        let mut file = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&temporary)
            .map_err(|source| io("write", source))?;
        file.write_all(&text)
            .map_err(|source| io("write", source))?;
        file.sync_all().map_err(|source| io("fsync", source))?;
        std::fs::rename(&temporary, &path).map_err(|source| io("rename", source))?;
        File::open(data_dir)
            .and_then(|directory| directory.sync_all())
            .map_err(|source| io("fsync", source))
    }

    fn rule(matcher: RuleMatch) -> Rule {
        Rule {
            matcher,
            window_ms: 2_000,
            threshold: 20,
            hot_duration_ms: 30_000,
            description: "test".to_owned(),
        }
    }

    #[test]
    fn given_saved_rules_when_loaded_then_same_including_binary_keys() {
        let directory = tempfile::tempdir().unwrap();
        let mut apps = BTreeMap::new();
        apps.insert(
            "shop".to_owned(),
            vec![
                rule(RuleMatch::Prefix(b"pin_".to_vec())),
                rule(RuleMatch::Exact(vec![0, 159, 146, 150])),
                rule(RuleMatch::Default),
            ],
        );
        save(directory.path(), &apps).unwrap();
        assert_eq!(load(directory.path()).unwrap(), apps);
    }

    #[test]
    fn given_no_file_then_no_rules_and_given_garbage_then_error_says_what_to_do() {
        let directory = tempfile::tempdir().unwrap();
        assert!(load(directory.path()).unwrap().is_empty());
        std::fs::write(directory.path().join(RULES_FILE_NAME), "{not json").unwrap();
        let message = load(directory.path()).unwrap_err().to_string();
        assert!(message.contains("is not valid"), "{message}");
        assert!(message.contains("move it away"), "{message}");
    }

    #[test]
    fn given_record_errors_then_messages_name_the_problem() {
        let mut record = rule_to_record(&rule(RuleMatch::Default));
        record.match_kind = "regex".to_owned();
        assert!(
            rule_from_record(&record)
                .unwrap_err()
                .contains("got 'regex'")
        );
        record.match_kind = "exact".to_owned();
        assert!(
            rule_from_record(&record)
                .unwrap_err()
                .contains("needs a key")
        );
    }

    /// A valid rules file, for mutating.
    fn valid_document() -> Vec<u8> {
        br#"{"format_version":1,"apps":{"shop":[{"match":"prefix","key":"pin_","window_ms":2000,"threshold":20,"hot_duration_ms":30000},{"match":"exact","key_hex":"00ff","window_ms":1000,"threshold":5,"hot_duration_ms":1000,"description":"d"}]}}"#.to_vec()
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// Arbitrary bytes and valid files with bytes changed, cut or added: the load answers
        /// rules or an error that names the file, never a panic.
        #[test]
        fn given_hostile_rules_files_then_load_answers_without_panicking(
            arbitrary in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
            changes in proptest::collection::vec(
                (proptest::prelude::any::<proptest::sample::Index>(), proptest::prelude::any::<u8>()),
                0..4,
            ),
            cut in proptest::option::of(proptest::prelude::any::<proptest::sample::Index>()),
        ) {
            let directory = tempfile::tempdir().unwrap();
            let mut mutated = valid_document();
            for (at, byte) in &changes {
                let at = at.index(mutated.len());
                mutated[at] = *byte;
            }
            if let Some(cut) = cut {
                mutated.truncate(cut.index(mutated.len()));
            }
            for bytes in [&arbitrary, &mutated] {
                std::fs::write(directory.path().join(RULES_FILE_NAME), bytes).unwrap();
                if let Err(error) = load(directory.path()) {
                    proptest::prop_assert!(error.to_string().contains(RULES_FILE_NAME), "{error}");
                }
                // The admin API's body is the same records.
                if let Ok(records) = serde_json::from_slice::<Vec<RuleRecord>>(bytes) {
                    for record in &records {
                        let _ = rule_from_record(record);
                    }
                }
            }
        }
    }
}
