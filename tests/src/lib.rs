//! understudy's end-to-end tests, which cross crates. The tests live in `tests/tests/`; the
//! emulated GPU nodes of the cluster tier live here, in [`nodes`].

pub mod nodes;

use std::net::SocketAddr;

/// A loopback port that refuses every connection, as a dead replica's does: bound, so the OS
/// gives it to nobody else while this lives, and never listened on, so a connect gets a reset.
#[derive(Debug)]
pub struct ClosedPort {
    _socket: tokio::net::TcpSocket,
    /// The port.
    pub port: u16,
}

impl ClosedPort {
    /// Binds a port the OS picks on 127.0.0.1, without listening.
    ///
    /// # Panics
    /// When no socket can be bound (a test cannot go on without one).
    #[must_use]
    #[allow(clippy::unwrap_used)]
    pub fn bind() -> ClosedPort {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
        let port = socket.local_addr().unwrap().port();
        ClosedPort {
            _socket: socket,
            port,
        }
    }

    /// Its address.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }
}
