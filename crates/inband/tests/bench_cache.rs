//! `inband bench cache --quick`: every backend × workload × thread count
//! produces a row with work done, and the stores are removed afterwards.

use std::process::Command;

#[test]
fn quick_run_has_a_row_per_backend_and_workload() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_inband"))
        .args(["bench", "cache", "--quick", "--dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let table = String::from_utf8(out.stdout).unwrap();
    for backend in ["lmdb", "rocksdb", "memory", "files"] {
        for workload in ["read-only", "99/1", "95/5", "90/10"] {
            for threads in ["1", "2"] {
                let row = table
                    .lines()
                    .find(|l| l.starts_with(&format!("| {backend} | {workload} | {threads} |")))
                    .unwrap_or_else(|| panic!("no row for {backend} {workload} {threads}t in\n{table}"));
                let ops: f64 = row.split('|').nth(4).unwrap().trim().parse().unwrap();
                assert!(ops > 0.0, "{row}");
            }
        }
        if backend != "memory" {
            let fill = table.lines().find(|l| l.starts_with(&format!("| {backend} | ")) && l.split('|').count() == 7).unwrap();
            for col in [3, 4] {
                let reopen_ms: f64 = fill.split('|').nth(col).unwrap().trim().parse().unwrap();
                assert!(reopen_ms > 0.0 && reopen_ms < 5000.0, "{fill}");
            }
        }
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "stores left behind");
}
