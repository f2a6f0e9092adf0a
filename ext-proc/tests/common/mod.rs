//! What the integration tests that run against a real `redis-server` share (`make setup`
//! installs it): a free loopback port and a server on it, killed when dropped.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::TcpListener as StdListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a server may take to listen.
pub const DEADLINE: Duration = Duration::from_secs(20);

/// A free loopback TCP port.
pub fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A `redis-server` without persistence on loopback port `.1`, killed (SIGKILL: its data is
/// gone) when dropped.
pub struct Redis(Child, pub u16);

impl Redis {
    /// On a free port.
    pub fn start() -> Self {
        Self::start_on(free_port())
    }

    /// On `port` (again, after one there was dropped: a server that came back empty).
    pub fn start_on(port: u16) -> Self {
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server on the PATH (make setup)");
        let start = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(start.elapsed() < DEADLINE, "redis-server did not listen on {port}");
            std::thread::sleep(Duration::from_millis(20));
        }
        Redis(child, port)
    }

    /// A connection of its own.
    pub async fn conn(&self) -> redis::aio::MultiplexedConnection {
        let client = redis::Client::open(format!("redis://127.0.0.1:{}", self.1)).unwrap();
        client.get_multiplexed_async_connection().await.unwrap()
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A leased (or plain) usage record with its settlements and its lease part, as a test builds it.
pub type RecordWrite = (
    gateway_ext_proc::metering::meter::UsageRecord,
    Vec<(gateway_ext_proc::admission::limits::BucketSpec, i64)>,
    Option<gateway_ext_proc::admission::admission_lease::LeaseUse>,
);

/// The ledger writes (records, not charges) of `writes`, in order.
pub fn record_writes(writes: &[RecordWrite]) -> Vec<gateway_ext_proc::store::LedgerWrite<'_>> {
    writes
        .iter()
        .map(|(record, settlements, lease)| gateway_ext_proc::store::LedgerWrite::Record {
            record,
            settlements,
            charge: false,
            lease: lease.as_ref(),
        })
        .collect()
}
