//! `cudagraph launch --nproc N -- <command...>`: starts N local processes of one distributed
//! job, the way `torchrun` does — each gets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` (and `NCCL_NVLS_ENABLE=0` unless set) —
//! prefixes every output line with its rank, and propagates failure: when one process exits
//! with an error, the others are stopped and the launcher exits with that process's status.
//! With `--nnodes`/`--node-rank` the same command on every machine forms one job.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;

#[derive(Args, Debug, Clone)]
pub struct LaunchArgs {
    /// Processes (GPUs) on this machine.
    #[arg(long, default_value_t = 1)]
    pub nproc: usize,
    /// Machines in the job.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This machine's index in 0..nnodes.
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// Host of global rank 0 (the machine with --node-rank 0).
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Rendezvous port on rank 0's host; a free one is picked on a single machine when left
    /// out.
    #[arg(long)]
    pub master_port: Option<u16>,
    /// The command to run, after `--`.
    #[arg(last = true, required = true)]
    pub command: Vec<OsString>,
}

/// Where output lines go: `(rank, is_stderr, line)`.
pub type Sink = Arc<dyn Fn(usize, bool, &str) + Send + Sync>;

/// The sink that prints `[rank N] line` to the launcher's own stdout/stderr.
pub fn print_sink() -> Sink {
    Arc::new(|rank, err, line| {
        if err {
            eprintln!("[rank {rank}] {line}");
        } else {
            outln!("[rank {rank}] {line}");
        }
    })
}

/// How the job ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// 0 when every process succeeded; else the first failed process's exit code (128 +
    /// signal for a signal).
    pub code: i32,
    /// The first process that failed (local rank) and how.
    pub failure: Option<(usize, String)>,
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn describe(status: ExitStatus) -> (i32, String) {
    if let Some(c) = status.code() {
        return (c, format!("exited with status {c}"));
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return (128 + sig, format!("was killed by signal {sig}"));
        }
    }
    (1, format!("ended with {status}"))
}

/// Forwards `from` line by line to `sink`; says so on `done` when the pipe closes.
fn pump(rank: usize, err: bool, from: impl Read + Send + 'static, sink: Sink, done: Sender<()>) {
    std::thread::spawn(move || {
        let mut r = BufReader::new(from);
        let mut line = Vec::new();
        loop {
            line.clear();
            match r.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let text = String::from_utf8_lossy(&line);
                    sink(rank, err, text.trim_end_matches(['\n', '\r']));
                }
            }
        }
        let _ = done.send(());
    });
}

/// Starts the local processes of the job and waits for them (see the module docs).
pub fn launch(a: &LaunchArgs, sink: Sink) -> Result<Outcome, String> {
    if a.nproc == 0 || a.nnodes == 0 {
        return Err("--nproc and --nnodes must be at least 1".into());
    }
    if a.node_rank >= a.nnodes {
        return Err(format!(
            "--node-rank {} is not below --nnodes {}",
            a.node_rank, a.nnodes
        ));
    }
    let Some((program, args)) = a.command.split_first() else {
        return Err("no command to run (give it after `--`)".into());
    };
    let port = match a.master_port {
        Some(p) => p,
        None if a.nnodes == 1 => free_port().map_err(|e| format!("no free local port: {e}"))?,
        None => {
            return Err(
                "--master-port is required with --nnodes > 1 (the same on every machine)".into(),
            )
        }
    };
    let world = a.nproc * a.nnodes;
    let mut children: Vec<Child> = Vec::with_capacity(a.nproc);
    let (pumped, pumps_done) = channel();
    let mut pumps = 0;
    for local in 0..a.nproc {
        let rank = a.node_rank * a.nproc + local;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", a.nproc.to_string())
            .env("GROUP_RANK", a.node_rank.to_string())
            .env("MASTER_ADDR", &a.master_addr)
            .env("MASTER_PORT", port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // NVLink SHARP (multicast) stays off unless the user asked for it.
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            cmd.env("NCCL_NVLS_ENABLE", "0");
        }
        match cmd.spawn() {
            Ok(mut c) => {
                if let Some(o) = c.stdout.take() {
                    pump(rank, false, o, sink.clone(), pumped.clone());
                    pumps += 1;
                }
                if let Some(e) = c.stderr.take() {
                    pump(rank, true, e, sink.clone(), pumped.clone());
                    pumps += 1;
                }
                children.push(c);
            }
            Err(e) => {
                for c in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(format!("cannot start `{}`: {e}", program.to_string_lossy()));
            }
        }
    }
    let mut done: Vec<Option<ExitStatus>> = vec![None; children.len()];
    let mut failure: Option<(usize, String, i32)> = None;
    loop {
        for (i, c) in children.iter_mut().enumerate() {
            if done[i].is_some() {
                continue;
            }
            match c.try_wait() {
                Ok(Some(st)) => {
                    done[i] = Some(st);
                    if !st.success() && failure.is_none() {
                        let (code, how) = describe(st);
                        failure = Some((i, how, code));
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    let _ = c.kill();
                    if failure.is_none() {
                        failure = Some((i, format!("could not be waited for: {e}"), 1));
                    }
                }
            }
        }
        if let Some((i, how, _)) = &failure {
            let running: Vec<usize> = (0..children.len()).filter(|&j| done[j].is_none()).collect();
            if !running.is_empty() {
                sink(
                    a.node_rank * a.nproc + i,
                    true,
                    &format!("launch: this process {how}; stopping local ranks {running:?}"),
                );
                for &j in &running {
                    let _ = children[j].kill();
                }
            }
        }
        if done.iter().all(Option::is_some) {
            break;
        }
        if failure.is_some() {
            // Killed above: collect them.
            for (j, c) in children.iter_mut().enumerate() {
                if done[j].is_none() {
                    done[j] = c.wait().ok().or(Some(ExitStatus::default()));
                }
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // The last lines: pipes close when the processes are gone — unless a process left
    // children of its own holding them; do not wait for those.
    let until = Instant::now() + Duration::from_secs(2);
    for _ in 0..pumps {
        if pumps_done
            .recv_timeout(until.saturating_duration_since(Instant::now()))
            .is_err()
        {
            break;
        }
    }
    Ok(match failure {
        None => Outcome {
            code: 0,
            failure: None,
        },
        Some((i, how, code)) => Outcome {
            code: if code == 0 { 1 } else { code },
            failure: Some((a.node_rank * a.nproc + i, how)),
        },
    })
}

/// `cudagraph launch`: runs the job, prints a one-line verdict on failure.
pub fn run(a: &LaunchArgs) -> Result<i32, Box<dyn std::error::Error>> {
    let out = launch(a, print_sink())?;
    if let Some((rank, how)) = &out.failure {
        eprintln!("launch: rank {rank} {how}; the job failed");
    }
    Ok(out.code)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::time::Instant;

    fn args(nproc: usize, script: &str) -> LaunchArgs {
        LaunchArgs {
            nproc,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: None,
            command: vec!["sh".into(), "-c".into(), script.into()],
        }
    }

    /// Lines as `(rank, from stderr, text)`.
    type Lines = Arc<Mutex<Vec<(usize, bool, String)>>>;

    fn capture() -> (Sink, Lines) {
        let lines: Lines = Arc::default();
        let l = lines.clone();
        (
            Arc::new(move |r, e, s: &str| l.lock().unwrap().push((r, e, s.to_string()))),
            lines,
        )
    }

    #[test]
    fn every_rank_gets_the_torchrun_variables() {
        let (sink, lines) = capture();
        let out = launch(
            &args(
                3,
                "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR\"; echo \"port $MASTER_PORT nvls ${NCCL_NVLS_ENABLE:-unset}\" >&2",
            ),
            sink,
        )
        .unwrap();
        assert_eq!(
            out,
            Outcome {
                code: 0,
                failure: None
            }
        );
        let lines = lines.lock().unwrap();
        for r in 0..3 {
            assert!(
                lines.contains(&(r, false, format!("{r} 3 {r} 3 127.0.0.1"))),
                "{lines:?}"
            );
            let err = lines
                .iter()
                .find(|(x, e, _)| *x == r && *e)
                .expect("stderr line");
            assert!(
                err.2.starts_with("port ") && !err.2.contains("port 0"),
                "{err:?}"
            );
            if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
                assert!(err.2.ends_with(" nvls 0"), "{err:?}");
            }
        }
        // One port for the whole job.
        let ports: std::collections::HashSet<_> =
            lines.iter().filter(|l| l.1).map(|l| l.2.clone()).collect();
        assert_eq!(ports.len(), 1, "{ports:?}");
    }

    #[test]
    fn a_failing_rank_stops_the_others_and_sets_the_exit_code() {
        let (sink, lines) = capture();
        let t = Instant::now();
        let out = launch(
            &args(
                3,
                "if [ \"$RANK\" = 1 ]; then echo dying >&2; exit 3; fi; sleep 30; echo survived",
            ),
            sink,
        )
        .unwrap();
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        assert_eq!(out.code, 3);
        assert_eq!(out.failure.as_ref().map(|f| f.0), Some(1));
        let lines = lines.lock().unwrap();
        assert!(lines.contains(&(1, true, "dying".into())));
        assert!(!lines.iter().any(|l| l.2 == "survived"), "{lines:?}");
    }

    #[test]
    fn a_rank_killed_by_a_signal_fails_the_job() {
        let (sink, _) = capture();
        let out = launch(
            &args(2, "if [ \"$RANK\" = 0 ]; then kill -9 $$; fi; sleep 30"),
            sink,
        )
        .unwrap();
        assert_eq!(out.code, 128 + 9);
        assert_eq!(out.failure.map(|f| f.0), Some(0));
    }

    #[test]
    fn bad_arguments_are_errors() {
        let (sink, _) = capture();
        let mut a = args(0, "true");
        assert!(launch(&a, sink.clone()).is_err());
        a.nproc = 1;
        a.nnodes = 2;
        assert!(launch(&a, sink.clone())
            .unwrap_err()
            .contains("--master-port"));
        a.nnodes = 1;
        a.node_rank = 1;
        assert!(launch(&a, sink.clone()).is_err());
        let mut a = args(1, "true");
        a.command = vec!["/nonexistent/program".into()];
        assert!(launch(&a, sink).unwrap_err().contains("cannot start"));
    }
}
