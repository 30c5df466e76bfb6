//! `streamalloc run`'s start-up window against signals: the launcher killed (SIGKILL), or
//! its process group interrupted (SIGINT, as Ctrl-C does), at instants spread over its
//! first milliseconds, while it finds its files, forks and starts the program. No child may
//! be left running without its launcher, and no Ctrl-C may be lost.
//!
//! CI runs 40 races of each kind; the acceptance's thousand are
//! `STREAMALLOC_RUN_RACES=1000 cargo test --release --test launcher_races`.

mod cli;

use std::os::unix::process::CommandExt;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

fn races() -> usize {
    std::env::var("STREAMALLOC_RUN_RACES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40)
}

/// How long the launcher takes to start its program here (this build, this machine): the
/// longest of a few launches, from spawning it to the program running.
fn start_up_window() -> Duration {
    let mut longest = Duration::ZERO;
    for i in 0..3 {
        let marker = format!("{}.9{i}", 900 + std::process::id() % 90);
        let started = Instant::now();
        let mut launcher = launch(&marker, false);
        while running(&marker).is_empty() && started.elapsed() < Duration::from_secs(10) {}
        longest = longest.max(started.elapsed());
        signal(launcher.id() as i32, libc::SIGKILL);
        launcher.wait().unwrap();
        let _ = survivor(&marker, Duration::from_secs(2));
    }
    longest
}

/// Delays spread over the start-up window and a little past it, the same every run
/// (xorshift).
fn delays(seed: u64) -> impl Iterator<Item = Duration> {
    let window = start_up_window().as_micros() as u64 * 3 / 2 + 1;
    let mut x = seed | 1;
    std::iter::repeat_with(move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        Duration::from_micros(x % window)
    })
}

/// `streamalloc run -- sleep MARKER`: the program is told apart by its argument.
fn launch(marker: &str, own_group: bool) -> Child {
    let mut command = cli::streamalloc();
    command
        .args(["run", "--", "sleep", marker])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if own_group {
        command.process_group(0);
    }
    // As a shell starts a foreground job: Ctrl-C and Ctrl-\ at their default actions, even
    // when these tests run where they are ignored (a background job of a script, nohup),
    // which the launcher, like any program, would rightly keep ignoring.
    // SAFETY: signal(2) is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        command.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            libc::signal(libc::SIGQUIT, libc::SIG_DFL);
            Ok(())
        })
    };
    command.spawn().unwrap()
}

/// Processes running `sleep MARKER`.
fn running(marker: &str) -> Vec<u32> {
    let wanted = format!("sleep\0{marker}\0");
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|cmdline| cmdline == wanted.as_bytes())
        })
        .collect()
}

/// Whether some process still runs `sleep MARKER` after `patience`.
fn survivor(marker: &str, patience: Duration) -> Option<u32> {
    let until = Instant::now() + patience;
    loop {
        let found = running(marker);
        if found.is_empty() {
            return None;
        }
        if Instant::now() > until {
            for &pid in &found {
                // SAFETY: kill(2) of a leftover test process, to clean up after a failure.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
            return found.first().copied();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn signal(pid: i32, signal: libc::c_int) {
    // SAFETY: kill(2) of a process (or, negative, a process group) this test started.
    unsafe { libc::kill(pid, signal) };
}

#[test]
fn a_launcher_killed_during_start_up_leaves_no_child() {
    let mut orphans = Vec::new();
    for (i, delay) in delays(0x5eed).take(races()).enumerate() {
        let marker = format!("{}.{i:04}", 600 + std::process::id() % 300);
        let mut launcher = launch(&marker, false);
        std::thread::sleep(delay);
        signal(launcher.id() as i32, libc::SIGKILL);
        launcher.wait().unwrap();
        if let Some(pid) = survivor(&marker, Duration::from_secs(2)) {
            orphans.push((delay, pid));
        }
    }
    assert!(
        orphans.is_empty(),
        "children outlived their launcher: {orphans:?}"
    );
}

/// The kernel ends the child when the launcher dies with a signal no program can ignore:
/// one that ignores SIGTERM (as `trap "" TERM` makes a shell and what it execs) dies too.
#[test]
fn a_child_that_ignores_sigterm_dies_with_its_killed_launcher() {
    let marker = format!("{}.5", 500 + std::process::id() % 90);
    let mut launcher = cli::streamalloc()
        .args(["run", "--", "sh", "-c"])
        .arg(format!("trap '' TERM; exec sleep {marker}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while running(&marker).is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the program never started"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    signal(launcher.id() as i32, libc::SIGKILL);
    launcher.wait().unwrap();
    assert_eq!(
        survivor(&marker, Duration::from_secs(3)),
        None,
        "the child outlived its launcher"
    );
}

#[test]
fn ctrl_c_during_start_up_is_never_lost() {
    let mut lost = Vec::new();
    for (i, delay) in delays(0xc7c).take(races()).enumerate() {
        let marker = format!("{}.{i:04}", 300 + std::process::id() % 300);
        let mut launcher = launch(&marker, true);
        std::thread::sleep(delay);
        // To the whole group, as a terminal does.
        signal(-(launcher.id() as i32), libc::SIGINT);
        let until = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(status) = launcher.try_wait().unwrap() {
                break Some(status);
            }
            if Instant::now() > until {
                break None;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        match status {
            // The program ended by the interrupt (the launcher reports 128 + 2), or the
            // launcher ended by it before it had started anything.
            Some(status) => {
                use std::os::unix::process::ExitStatusExt;
                let interrupted =
                    status.code() == Some(130) || status.signal() == Some(libc::SIGINT);
                if !interrupted {
                    lost.push((delay, format!("{status:?}")));
                }
            }
            None => {
                signal(-(launcher.id() as i32), libc::SIGKILL);
                let _ = launcher.wait();
                lost.push((delay, "still running".into()));
            }
        }
        if let Some(pid) = survivor(&marker, Duration::from_secs(2)) {
            lost.push((delay, format!("sleep {pid} survived")));
        }
    }
    assert!(lost.is_empty(), "interrupts lost: {lost:?}");
}
