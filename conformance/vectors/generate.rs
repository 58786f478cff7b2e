// Prints the routing and partitioning test vectors of the Rust client as JSON.
use std::hash::BuildHasher;

fn mix(mut value: u64) -> u64 {
    value = (value ^ (value >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    value = (value ^ (value >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    value ^ (value >> 31)
}
fn rendezvous(key_hash: u64, seeds: &[u64], eligible: impl Fn(usize) -> bool) -> Option<usize> {
    seeds.iter().copied().enumerate().filter(|(i, _)| eligible(*i))
        .max_by_key(|(_, seed)| mix(key_hash ^ seed)).map(|(i, _)| i)
}
fn hex(bytes: &[u8]) -> String { bytes.iter().map(|b| format!("{b:02x}")).collect() }

fn main() {
    let hasher = foldhash::fast::FixedState::with_seed(0x686f_746b_6579_7321);
    let mut keys: Vec<Vec<u8>> = Vec::new();
    for text in ["", "a", "ab", "abc", "pin_42", "flash-sale", "user:1", "user:2", "hot-key-7"] {
        keys.push(text.as_bytes().to_vec());
    }
    for length in [4usize, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 48, 63, 64, 65, 100, 128, 200, 255, 256, 257, 300, 320, 511, 1024] {
        keys.push((0..length).map(|i| ((i * 31 + length) % 251) as u8).collect());
    }
    for number in 0..40u32 { keys.push(format!("key-{number}").into_bytes()); }
    keys.push(vec![0, 255, 0, 255]);
    let server_lists: Vec<Vec<&str>> = vec![
        vec!["127.0.0.1:7070"],
        vec!["127.0.0.1:7070", "127.0.0.1:7071"],
        vec!["127.0.0.1:7070", "127.0.0.1:7071", "127.0.0.1:7072"],
        vec!["10.0.0.1:7070", "10.0.0.2:7070", "10.0.0.3:7070", "10.0.0.4:7070", "10.0.0.5:7070"],
        vec!["levee-a.internal:7070", "levee-b.internal:7070", "http://levee-c.internal:7070"],
    ];
    let mut out = String::from("{\n  \"key_hashes\": [\n");
    let entries: Vec<String> = keys.iter().map(|key| format!(
        "    {{\"key_hex\": \"{}\", \"hash\": \"{:016x}\", \"xxh3_64\": \"{:016x}\"}}",
        hex(key), hasher.hash_one(key.as_slice()), xxhash_rust::xxh3::xxh3_64(key))).collect();
    out += &entries.join(",\n");
    out += "\n  ],\n  \"routes\": [\n";
    let mut routes = Vec::new();
    for servers in &server_lists {
        let seeds: Vec<u64> = servers.iter().map(|a| hasher.hash_one(a.as_bytes())).collect();
        let all: Vec<String> = keys.iter().map(|k| rendezvous(hasher.hash_one(k.as_slice()), &seeds, |_| true).unwrap().to_string()).collect();
        let without_first: Vec<String> = keys.iter().map(|k| match rendezvous(hasher.hash_one(k.as_slice()), &seeds, |i| i != 0) { Some(i) => i.to_string(), None => "null".into() }).collect();
        let quoted: Vec<String> = servers.iter().map(|s| format!("\"{s}\"")).collect();
        let seed_text: Vec<String> = seeds.iter().map(|s| format!("\"{s:016x}\"")).collect();
        routes.push(format!("    {{\"servers\": [{}], \"seeds\": [{}], \"server_of\": [{}], \"server_of_without_first\": [{}]}}",
            quoted.join(", "), seed_text.join(", "), all.join(", "), without_first.join(", ")));
    }
    out += &routes.join(",\n");
    out += "\n  ],\n  \"partitions\": [\n";
    let mut parts = Vec::new();
    for count in [1u32, 2, 3, 7, 10, 16, 64, 1000, 1024] {
        let values: Vec<String> = keys.iter().map(|k| ((xxhash_rust::xxh3::xxh3_64(k) % u64::from(count)) as u32).to_string()).collect();
        parts.push(format!("    {{\"partitions\": {count}, \"partition_of\": [{}]}}", values.join(", ")));
    }
    out += &parts.join(",\n");
    out += "\n  ]\n}\n";
    print!("{out}");
}
