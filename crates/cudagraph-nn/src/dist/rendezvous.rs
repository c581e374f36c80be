//! The rendezvous: rank 0 listens on `MASTER_ADDR:MASTER_PORT`, every other rank connects
//! (retrying until rank 0 is up), says who it is, and receives a payload from rank 0 — the
//! NCCL unique id. Plain std TCP, no extra service, so it works on one machine and across
//! machines; every step has a deadline and every failure says what to check.
//!
//! The connections then stay open as a liveness channel ([`PeerMonitor`]): heartbeats every
//! second, a goodbye on clean shutdown, and failure reports relayed by rank 0. A peer whose
//! connection closes without a goodbye (the process died), or that stops sending heartbeats
//! (its host or network is down), is recorded in the shared [`Health`], which communicators
//! poll while they wait for collectives. Nothing here touches the GPU.

use std::io::{ErrorKind, Read, Write};
use std::net::{
    IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{DistEnv, DistError};

const MAGIC: &[u8; 8] = b"CGRDZV01";
/// Largest frame payload accepted (ids are 128 bytes; messages are short).
const MAX_PAYLOAD: usize = 64 * 1024;
const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);
const TICK: Duration = Duration::from_millis(20);

/// Frame kinds: `[kind: u8][len: u32 LE][payload]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    Hello = 1,
    Payload = 2,
    Error = 3,
    Heartbeat = 4,
    Bye = 5,
    Fail = 6,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Hello,
            2 => Kind::Payload,
            3 => Kind::Error,
            4 => Kind::Heartbeat,
            5 => Kind::Bye,
            6 => Kind::Fail,
            _ => return None,
        })
    }
}

fn encode(kind: Kind, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(5 + payload.len());
    v.push(kind as u8);
    v.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    v.extend_from_slice(payload);
    v
}

/// Takes one complete frame off the front of `buf`: `Ok(None)` when more bytes are needed,
/// an error for bytes that are not a frame of ours.
fn decode(buf: &mut Vec<u8>) -> Result<Option<(Kind, Vec<u8>)>, String> {
    if buf.len() < 5 {
        return Ok(None);
    }
    let kind = Kind::from_u8(buf[0]).ok_or_else(|| format!("unknown message kind {}", buf[0]))?;
    let len = u32::from_le_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(format!("message of {len} bytes is too long"));
    }
    if buf.len() < 5 + len {
        return Ok(None);
    }
    let payload = buf[5..5 + len].to_vec();
    buf.drain(..5 + len);
    Ok(Some((kind, payload)))
}

/// Reads one whole frame from a blocking stream (its read timeout bounds the wait).
fn read_frame(s: &mut TcpStream) -> std::io::Result<(Kind, Vec<u8>)> {
    let mut head = [0u8; 5];
    s.read_exact(&mut head)?;
    let kind = Kind::from_u8(head[0])
        .ok_or_else(|| std::io::Error::new(ErrorKind::InvalidData, "not a rendezvous message"))?;
    let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            "rendezvous message too long",
        ));
    }
    let mut payload = vec![0u8; len];
    s.read_exact(&mut payload)?;
    Ok((kind, payload))
}

/// Who a connecting rank says it is.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Hello {
    rank: u32,
    world: u32,
    host: String,
}

impl Hello {
    fn encode(&self) -> Vec<u8> {
        let mut v = MAGIC.to_vec();
        v.extend_from_slice(&self.rank.to_le_bytes());
        v.extend_from_slice(&self.world.to_le_bytes());
        v.extend_from_slice(self.host.as_bytes());
        v
    }

    fn decode(p: &[u8]) -> Option<Hello> {
        if p.len() < 16 || &p[..8] != MAGIC {
            return None;
        }
        let rank = u32::from_le_bytes([p[8], p[9], p[10], p[11]]);
        let world = u32::from_le_bytes([p[12], p[13], p[14], p[15]]);
        Some(Hello {
            rank,
            world,
            host: String::from_utf8_lossy(&p[16..]).into_owned(),
        })
    }
}

fn host_name() -> String {
    crate::env::var("HOSTNAME")
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|h| h.trim().to_string())
        })
        .unwrap_or_else(|| "unknown-host".into())
}

/// What every rank shares after the rendezvous: failures of any rank, recorded once.
#[derive(Debug, Default)]
pub struct Health {
    failure: Mutex<Option<String>>,
}

impl Health {
    /// A fresh record with no failure.
    pub fn new() -> Arc<Health> {
        Arc::new(Health::default())
    }

    /// Records a failure; the first one is kept (it is usually the cause of the rest).
    /// Returns whether this was the first.
    pub fn fail(&self, what: impl Into<String>) -> bool {
        let mut f = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        if f.is_some() {
            return false;
        }
        *f = Some(what.into());
        true
    }

    /// The first failure recorded, if any.
    pub fn failure(&self) -> Option<String> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// The result of a rendezvous.
#[derive(Debug)]
pub struct Membership {
    /// This process's rank, in `0..world_size`.
    pub rank: usize,
    /// Number of ranks in the group.
    pub world_size: usize,
    /// What rank 0 handed out (the NCCL unique id).
    pub payload: Vec<u8>,
    /// The liveness channel to the other ranks (`None` for a world of one).
    pub monitor: Option<PeerMonitor>,
}

/// Resolves `host:port` (IPv4 first).
fn resolve(env: &DistEnv) -> Result<SocketAddr, DistError> {
    let target = format!("{}:{}", env.master_addr, env.master_port);
    let addrs: Vec<SocketAddr> = (env.master_addr.as_str(), env.master_port)
        .to_socket_addrs()
        .map_err(|e| DistError::Rendezvous {
            addr: target.clone(),
            problem: format!("cannot resolve MASTER_ADDR: {e}"),
        })?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or_else(|| addrs.first())
        .copied()
        .ok_or(DistError::Rendezvous {
            addr: target,
            problem: "MASTER_ADDR resolves to no address".into(),
        })
}

/// Runs the rendezvous for this process. Rank 0 calls `payload` once every rank has
/// connected and hands its result to all; the others return what they received.
/// `timeout` bounds the whole exchange on every rank.
pub fn rendezvous(
    env: &DistEnv,
    timeout: Duration,
    heartbeat_timeout: Duration,
    payload: impl FnOnce() -> Result<Vec<u8>, DistError>,
) -> Result<Membership, DistError> {
    if env.world_size <= 1 {
        return Ok(Membership {
            rank: 0,
            world_size: 1,
            payload: payload()?,
            monitor: None,
        });
    }
    let addr = resolve(env)?;
    let deadline = Instant::now() + timeout;
    if env.rank == 0 {
        serve(env, addr, deadline, timeout, heartbeat_timeout, payload)
    } else {
        join(env, addr, deadline, timeout, heartbeat_timeout)
    }
}

fn rdzv_err(addr: SocketAddr, problem: impl Into<String>) -> DistError {
    DistError::Rendezvous {
        addr: addr.to_string(),
        problem: problem.into(),
    }
}

/// Rank 0: accept `world_size - 1` ranks, then send each the payload.
fn serve(
    env: &DistEnv,
    addr: SocketAddr,
    deadline: Instant,
    timeout: Duration,
    heartbeat_timeout: Duration,
    payload: impl FnOnce() -> Result<Vec<u8>, DistError>,
) -> Result<Membership, DistError> {
    // Listen where the others will look: the address itself when it is a loopback one (one
    // machine), every interface of its family otherwise.
    let bind = if addr.ip().is_loopback() {
        addr
    } else {
        let any = match addr.ip() {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        };
        SocketAddr::new(any, addr.port())
    };
    let listener = TcpListener::bind(bind).map_err(|e| {
        rdzv_err(
            addr,
            format!("rank 0 cannot listen on {bind}: {e} (is MASTER_PORT in use by another job?)"),
        )
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|e| rdzv_err(addr, format!("listener: {e}")))?;
    let world = env.world_size;
    let mut peers: Vec<Option<(TcpStream, Hello)>> = (0..world).map(|_| None).collect();
    let mut joined = 1;
    // Tell every connected rank why the rendezvous failed before failing here.
    let fail = |peers: &mut Vec<Option<(TcpStream, Hello)>>, e: DistError| -> DistError {
        let msg = encode(Kind::Error, e.to_string().as_bytes());
        for (s, _) in peers.iter_mut().flatten() {
            let _ = s.write_all(&msg);
        }
        e
    };
    while joined < world {
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<usize> = (1..world).filter(|&r| peers[r].is_none()).collect();
            let e = DistError::Timeout {
                what: format!("rendezvous on {bind}"),
                secs: timeout.as_secs_f64(),
                hint: format!(
                    "ranks {missing:?} never connected ({joined} of {world} here); start every rank with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE, and check that rank 0's host is reachable"
                ),
            };
            return Err(fail(&mut peers, e));
        }
        let (mut s, from) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(fail(&mut peers, rdzv_err(addr, format!("accept: {e}")))),
        };
        // A connection that does not introduce itself promptly is not one of ours.
        let wait = deadline
            .saturating_duration_since(now)
            .min(Duration::from_secs(10))
            .max(Duration::from_millis(1));
        if s.set_nonblocking(false).is_err() || s.set_read_timeout(Some(wait)).is_err() {
            continue;
        }
        let hello = match read_frame(&mut s) {
            Ok((Kind::Hello, p)) => match Hello::decode(&p) {
                Some(h) => h,
                None => continue,
            },
            _ => continue,
        };
        let problem = if hello.world as usize != world {
            Some(format!(
                "rank {} on {} ({from}) has WORLD_SIZE={}, rank 0 has {world}",
                hello.rank, hello.host, hello.world
            ))
        } else if hello.rank == 0 || hello.rank as usize >= world {
            Some(format!(
                "a process on {} ({from}) claims rank {} of {world}; ranks 1..{world} connect to rank 0",
                hello.host, hello.rank
            ))
        } else if let Some((_, first)) = &peers[hello.rank as usize] {
            Some(format!(
                "rank {} connected twice (from {} and {} ({from})); every process needs its own RANK",
                hello.rank, first.host, hello.host
            ))
        } else {
            None
        };
        if let Some(p) = problem {
            let e = rdzv_err(addr, p);
            let _ = s.write_all(&encode(Kind::Error, e.to_string().as_bytes()));
            return Err(fail(&mut peers, e));
        }
        let r = hello.rank as usize;
        peers[r] = Some((s, hello));
        joined += 1;
    }
    let id = match payload() {
        Ok(id) => id,
        Err(e) => return Err(fail(&mut peers, e)),
    };
    let msg = encode(Kind::Payload, &id);
    let mut links = Vec::with_capacity(world - 1);
    for (r, p) in peers.into_iter().enumerate() {
        let Some((mut s, hello)) = p else { continue };
        s.write_all(&msg).map_err(|e| {
            rdzv_err(
                addr,
                format!("sending the NCCL id to rank {r} on {}: {e}", hello.host),
            )
        })?;
        links.push(Link::new(r, hello.host, s));
    }
    Ok(Membership {
        rank: 0,
        world_size: world,
        payload: id,
        monitor: Some(PeerMonitor::start(0, links, heartbeat_timeout)?),
    })
}

/// Ranks 1..: connect to rank 0 (retrying until it listens), introduce, receive the payload.
fn join(
    env: &DistEnv,
    addr: SocketAddr,
    deadline: Instant,
    timeout: Duration,
    heartbeat_timeout: Duration,
) -> Result<Membership, DistError> {
    let mut s = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let last = match TcpStream::connect_timeout(
            &addr,
            left.clamp(Duration::from_millis(1), Duration::from_secs(5)),
        ) {
            Ok(s) => break s,
            Err(e) => e,
        };
        if Instant::now() + Duration::from_millis(200) >= deadline {
            return Err(DistError::Timeout {
                what: format!("rank {} connecting to rank 0 at {addr}", env.rank),
                secs: timeout.as_secs_f64(),
                hint: format!(
                    "last attempt: {last}; is rank 0 running with MASTER_ADDR/MASTER_PORT set to this address, and is it reachable from this host?"
                ),
            });
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let io = |e: std::io::Error| rdzv_err(addr, format!("talking to rank 0: {e}"));
    s.set_nodelay(true).map_err(io)?;
    let hello = Hello {
        rank: env.rank as u32,
        world: env.world_size as u32,
        host: host_name(),
    };
    s.write_all(&encode(Kind::Hello, &hello.encode()))
        .map_err(io)?;
    let left = deadline.saturating_duration_since(Instant::now());
    s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
        .map_err(io)?;
    match read_frame(&mut s) {
        Ok((Kind::Payload, id)) => {
            let link = Link::new(0, "rank 0".into(), s);
            Ok(Membership {
                rank: env.rank,
                world_size: env.world_size,
                payload: id,
                monitor: Some(PeerMonitor::start(env.rank, vec![link], heartbeat_timeout)?),
            })
        }
        Ok((Kind::Error, msg)) => Err(rdzv_err(
            addr,
            format!("rank 0 refused: {}", String::from_utf8_lossy(&msg)),
        )),
        Ok((k, _)) => Err(rdzv_err(addr, format!("unexpected {k:?} from rank 0"))),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
            Err(DistError::Timeout {
                what: format!("rank {} waiting for rank 0 to hand out the NCCL id", env.rank),
                secs: timeout.as_secs_f64(),
                hint: "rank 0 is up but other ranks never connected; check that every rank was started with the same WORLD_SIZE".into(),
            })
        }
        Err(e) if e.kind() == ErrorKind::UnexpectedEof => Err(rdzv_err(
            addr,
            "rank 0 closed the connection during the rendezvous (it failed or exited)",
        )),
        Err(e) => Err(io(e)),
    }
}

/// One open connection to another rank, polled by the monitor thread.
struct Link {
    rank: usize,
    host: String,
    stream: TcpStream,
    inbuf: Vec<u8>,
    outbuf: Vec<u8>,
    last_seen: Instant,
    /// The peer said goodbye: its connection closing is not a failure.
    said_bye: bool,
    /// Nothing more to read or write.
    closed: bool,
}

impl Link {
    fn new(rank: usize, host: String, stream: TcpStream) -> Link {
        Link {
            rank,
            host,
            stream,
            inbuf: Vec::new(),
            outbuf: Vec::new(),
            last_seen: Instant::now(),
            said_bye: false,
            closed: false,
        }
    }

    fn who(&self) -> String {
        format!("rank {} ({})", self.rank, self.host)
    }

    fn send(&mut self, kind: Kind, payload: &[u8]) {
        if !self.closed {
            self.outbuf.extend_from_slice(&encode(kind, payload));
        }
    }

    /// Writes what the socket takes now.
    fn flush(&mut self) {
        while !self.closed && !self.outbuf.is_empty() {
            match self.stream.write(&self.outbuf) {
                Ok(0) => break,
                Ok(n) => {
                    self.outbuf.drain(..n);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                // Full (WouldBlock) or broken: reading reports a broken connection.
                Err(_) => break,
            }
        }
    }
}

/// The liveness channel of one process to the others, kept open after the rendezvous by a
/// background thread: heartbeats out every second, and failures into [`Health`]:
/// a connection that closes without a goodbye, a peer silent for longer than the heartbeat
/// timeout, or a failure a peer reports. Rank 0 relays every failure to all ranks.
/// Dropping the monitor says goodbye to every peer (a clean exit is not a failure).
#[derive(Debug)]
pub struct PeerMonitor {
    health: Arc<Health>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    rank: usize,
}

impl PeerMonitor {
    fn start(
        rank: usize,
        mut links: Vec<Link>,
        heartbeat_timeout: Duration,
    ) -> Result<PeerMonitor, DistError> {
        for l in &mut links {
            l.stream
                .set_nonblocking(true)
                .map_err(|e| DistError::Rendezvous {
                    addr: l.who(),
                    problem: format!("cannot poll the connection: {e}"),
                })?;
            let _ = l.stream.set_nodelay(true);
        }
        let health = Health::new();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (health, stop) = (health.clone(), stop.clone());
            std::thread::Builder::new()
                .name(format!("cudagraph-peers-{rank}"))
                .spawn(move || monitor_loop(rank, links, &health, &stop, heartbeat_timeout))
                .map_err(|e| {
                    DistError::Usage(format!("cannot start the peer monitor thread: {e}"))
                })?
        };
        Ok(PeerMonitor {
            health,
            stop,
            thread: Some(thread),
            rank,
        })
    }

    /// The shared failure record.
    pub fn health(&self) -> &Arc<Health> {
        &self.health
    }

    /// Reports a failure of this process to every peer (they fail fast with this message
    /// instead of waiting for a timeout).
    pub fn report_failure(&self, what: &str) {
        self.health.fail(format!("rank {}: {what}", self.rank));
    }
}

impl Drop for PeerMonitor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn monitor_loop(
    rank: usize,
    mut links: Vec<Link>,
    health: &Health,
    stop: &AtomicBool,
    heartbeat_timeout: Duration,
) {
    let mut last_beat = Instant::now() - HEARTBEAT_EVERY;
    let mut relayed = false;
    let mut buf = [0u8; 4096];
    loop {
        if stop.load(Ordering::Acquire) {
            // Goodbye, unless this process failed (then the others must not take its exit
            // for a clean one).
            let kind = if health.failure().is_some() {
                Kind::Fail
            } else {
                Kind::Bye
            };
            let msg = health.failure().unwrap_or_default();
            for l in &mut links {
                l.send(kind, msg.as_bytes());
                let _ = l.stream.set_nonblocking(false);
                let _ = l.stream.set_write_timeout(Some(Duration::from_secs(1)));
                l.flush();
                let _ = l.stream.shutdown(Shutdown::Both);
            }
            return;
        }
        if last_beat.elapsed() >= HEARTBEAT_EVERY {
            last_beat = Instant::now();
            for l in &mut links {
                l.send(Kind::Heartbeat, &[]);
            }
        }
        if !relayed {
            if let Some(f) = health.failure() {
                relayed = true;
                for l in &mut links {
                    l.send(Kind::Fail, f.as_bytes());
                }
            }
        }
        for l in &mut links {
            l.flush();
            if l.closed {
                continue;
            }
            // Read everything available, handling each message as it completes (a goodbye
            // followed by the connection closing is a clean exit).
            loop {
                let eof = match l.stream.read(&mut buf) {
                    Ok(0) => Some(None),
                    Ok(n) => {
                        l.last_seen = Instant::now();
                        l.inbuf.extend_from_slice(&buf[..n]);
                        None
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) => Some(Some(e)),
                };
                loop {
                    match decode(&mut l.inbuf) {
                        Ok(Some((Kind::Bye, _))) => l.said_bye = true,
                        Ok(Some((Kind::Fail | Kind::Error, msg))) => {
                            let msg = String::from_utf8_lossy(&msg).into_owned();
                            // Rank 0 names the origin; the others get it already named.
                            health.fail(if rank == 0 {
                                format!("{} reported: {msg}", l.who())
                            } else {
                                msg
                            });
                        }
                        Ok(Some(_)) => {}
                        Ok(None) => break,
                        Err(e) => {
                            health.fail(format!("{} sent garbage: {e}", l.who()));
                            l.closed = true;
                            break;
                        }
                    }
                }
                if let Some(err) = eof {
                    if !l.said_bye {
                        let how = match err {
                            None => "closed its connection".to_string(),
                            Some(e) => format!("lost its connection ({e})"),
                        };
                        health.fail(format!(
                            "{} {how} without finishing: the process exited or crashed, or the network failed",
                            l.who()
                        ));
                    }
                    l.closed = true;
                }
                if l.closed {
                    break;
                }
            }
            if !l.closed && !l.said_bye && l.last_seen.elapsed() > heartbeat_timeout {
                health.fail(format!(
                    "no heartbeat from {} for {:.0} s: its host or network is down, or the process is stopped",
                    l.who(),
                    heartbeat_timeout.as_secs_f64()
                ));
                l.closed = true;
            }
        }
        std::thread::sleep(TICK);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    fn env(rank: usize, world: usize, port: u16) -> DistEnv {
        DistEnv {
            rank,
            world_size: world,
            local_rank: rank,
            master_addr: "127.0.0.1".into(),
            master_port: port,
        }
    }

    fn wait_for_failure(h: &Health, within: Duration) -> Option<String> {
        let t = Instant::now();
        while t.elapsed() < within {
            if let Some(f) = h.failure() {
                return Some(f);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    #[test]
    fn frames_round_trip_and_reject_garbage() {
        let mut buf = encode(Kind::Payload, b"abc");
        buf.extend(encode(Kind::Bye, &[]));
        buf.extend_from_slice(&[4, 0]); // a partial heartbeat
        assert_eq!(
            decode(&mut buf).unwrap(),
            Some((Kind::Payload, b"abc".to_vec()))
        );
        assert_eq!(decode(&mut buf).unwrap(), Some((Kind::Bye, vec![])));
        assert_eq!(decode(&mut buf).unwrap(), None);
        assert!(decode(&mut vec![99, 0, 0, 0, 0]).is_err());
        assert!(decode(&mut vec![2, 255, 255, 255, 255]).is_err());
        let h = Hello {
            rank: 3,
            world: 4,
            host: "node-7".into(),
        };
        assert_eq!(Hello::decode(&h.encode()), Some(h));
        assert_eq!(Hello::decode(b"CGRDZV00xxxxxxxx"), None);
    }

    /// Rank 0 and rank 1 as two threads over loopback: the payload arrives, rank 1 may start
    /// first (it retries until rank 0 listens), and clean exits are not failures.
    #[test]
    fn two_ranks_exchange_the_payload_over_loopback() {
        let port = free_port();
        let t = Duration::from_secs(20);
        let hb = Duration::from_secs(30);
        let r1 = std::thread::spawn(move || rendezvous(&env(1, 2, port), t, hb, || unreachable!()));
        std::thread::sleep(Duration::from_millis(300));
        let m0 = rendezvous(&env(0, 2, port), t, hb, || Ok(vec![7u8; 128])).unwrap();
        let m1 = r1.join().unwrap().unwrap();
        assert_eq!((m0.rank, m0.world_size), (0, 2));
        assert_eq!((m1.rank, m1.world_size), (1, 2));
        assert_eq!(m0.payload, vec![7u8; 128]);
        assert_eq!(m1.payload, m0.payload);
        let (h0, h1) = (
            m0.monitor.as_ref().unwrap().health().clone(),
            m1.monitor.as_ref().unwrap().health().clone(),
        );
        // Heartbeats keep an idle link healthy.
        std::thread::sleep(Duration::from_millis(1500));
        assert_eq!(h0.failure(), None);
        assert_eq!(h1.failure(), None);
        drop(m1); // goodbye
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(h0.failure(), None, "a clean exit is not a failure");
    }

    /// A bare rank that introduces itself, takes the payload, then behaves as told.
    fn bare_rank(
        port: u16,
        rank: u32,
        world: u32,
        then: impl FnOnce(TcpStream) + Send + 'static,
    ) -> JoinHandle<()> {
        std::thread::spawn(move || {
            let mut s = loop {
                match TcpStream::connect(("127.0.0.1", port)) {
                    Ok(s) => break s,
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            };
            let hello = Hello {
                rank,
                world,
                host: "bare".into(),
            };
            s.write_all(&encode(Kind::Hello, &hello.encode())).unwrap();
            assert_eq!(read_frame(&mut s).unwrap().0, Kind::Payload);
            then(s);
        })
    }

    /// A rank whose process dies (its socket closes without a goodbye) is noticed by rank 0
    /// at once, and rank 0 relays the failure to the other ranks.
    #[test]
    fn a_dead_rank_is_noticed_and_relayed() {
        let port = free_port();
        let t = Duration::from_secs(20);
        let hb = Duration::from_secs(30);
        let r1 = std::thread::spawn(move || rendezvous(&env(1, 3, port), t, hb, || unreachable!()));
        // Rank 2 crashes right after the rendezvous: its connection just closes.
        let r2 = bare_rank(port, 2, 3, |s| {
            std::thread::sleep(Duration::from_millis(300));
            drop(s);
        });
        let m0 = rendezvous(&env(0, 3, port), t, hb, || Ok(b"id".to_vec())).unwrap();
        let m1 = r1.join().unwrap().unwrap();
        r2.join().unwrap();
        let f0 = wait_for_failure(
            m0.monitor.as_ref().unwrap().health(),
            Duration::from_secs(5),
        )
        .expect("rank 0 notices");
        assert!(
            f0.contains("rank 2") && f0.contains("exited or crashed"),
            "{f0}"
        );
        let f1 = wait_for_failure(
            m1.monitor.as_ref().unwrap().health(),
            Duration::from_secs(5),
        )
        .expect("relayed to rank 1");
        assert!(f1.contains("rank 2"), "{f1}");
    }

    /// A failure a rank reports itself reaches rank 0 with its message.
    #[test]
    fn a_reported_failure_reaches_rank_0() {
        let port = free_port();
        let t = Duration::from_secs(20);
        let hb = Duration::from_secs(30);
        let r1 = std::thread::spawn(move || rendezvous(&env(1, 2, port), t, hb, || unreachable!()));
        let m0 = rendezvous(&env(0, 2, port), t, hb, || Ok(b"id".to_vec())).unwrap();
        let m1 = r1.join().unwrap().unwrap();
        m1.monitor
            .as_ref()
            .unwrap()
            .report_failure("out of memory in step 7");
        let f0 = wait_for_failure(
            m0.monitor.as_ref().unwrap().health(),
            Duration::from_secs(5),
        )
        .expect("rank 0 hears of it");
        assert!(
            f0.contains("rank 1") && f0.contains("out of memory in step 7"),
            "{f0}"
        );
        // Exiting after a failure is not a goodbye either.
        drop(m1);
    }

    #[test]
    fn a_rank_that_stops_answering_misses_its_heartbeats() {
        let port = free_port();
        let t = Duration::from_secs(20);
        // Rank 1 introduces itself and then stays silent.
        let h = bare_rank(port, 1, 2, |s| {
            std::thread::sleep(Duration::from_secs(4));
            drop(s);
        });
        let m0 = rendezvous(&env(0, 2, port), t, Duration::from_millis(1500), || {
            Ok(b"id".to_vec())
        })
        .unwrap();
        let f = wait_for_failure(
            m0.monitor.as_ref().unwrap().health(),
            Duration::from_secs(3),
        )
        .expect("missed heartbeats are a failure");
        assert!(f.contains("no heartbeat from rank 1"), "{f}");
        h.join().unwrap();
    }

    #[test]
    fn a_missing_rank_0_times_out_with_a_clear_error() {
        let port = free_port();
        let t0 = Instant::now();
        let e = rendezvous(
            &env(1, 2, port),
            Duration::from_millis(800),
            Duration::from_secs(30),
            || unreachable!(),
        )
        .unwrap_err();
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
        let msg = e.to_string();
        assert!(matches!(e, DistError::Timeout { .. }), "{msg}");
        assert!(msg.contains("connecting to rank 0"), "{msg}");
    }

    #[test]
    fn a_missing_rank_makes_rank_0_time_out_naming_it() {
        let port = free_port();
        let e = rendezvous(
            &env(0, 3, port),
            Duration::from_millis(600),
            Duration::from_secs(30),
            || unreachable!("no payload without everyone"),
        )
        .unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("[1, 2]"), "{msg}");
    }

    #[test]
    fn mismatched_world_sizes_are_refused_on_both_sides() {
        let port = free_port();
        let t = Duration::from_secs(10);
        let hb = Duration::from_secs(30);
        let r1 = std::thread::spawn(move || rendezvous(&env(1, 3, port), t, hb, || unreachable!()));
        let e0 = rendezvous(&env(0, 2, port), t, hb, || Ok(vec![1])).unwrap_err();
        assert!(e0.to_string().contains("WORLD_SIZE=3"), "{e0}");
        let e1 = r1.join().unwrap().unwrap_err();
        assert!(e1.to_string().contains("refused"), "{e1}");
    }

    #[test]
    fn one_process_needs_no_network() {
        let m = rendezvous(
            &DistEnv::single(),
            Duration::from_millis(1),
            Duration::from_secs(1),
            || Ok(vec![5]),
        )
        .unwrap();
        assert_eq!((m.rank, m.world_size, m.payload), (0, 1, vec![5]));
        assert!(m.monitor.is_none());
    }
}
