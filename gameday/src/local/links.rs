//! The network between the run's parties, as relays the run can cut: the failover logic's calls
//! to each replica and fence, and each fence's calls to the other pool's fences, go through a
//! loopback relay of their own, while the routers reach the fences directly (the data path a
//! region's clients keep). Cutting a pool's links black-holes every relay it is a party to: bytes
//! stop moving and connections stay open, as across a real partition, so callers learn of it by
//! their own timeouts rather than a refused connection.
//!
//! What this module must never do: move a byte across a cut link, or leave a relay running once
//! the run is dropped.

use std::net::SocketAddr;
use std::sync::Mutex;

use tokio::io::copy_bidirectional;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use understudy_core::Pool;

use super::lock;

/// Every relay of the run; dropped with it.
#[derive(Debug, Default)]
pub struct Links {
    /// Whether each pool is cut off.
    cut: [Mutex<Option<watch::Sender<bool>>>; 2],
    relays: Mutex<JoinSet<()>>,
}

impl Links {
    fn cut_of(&self, pool: Pool) -> watch::Receiver<bool> {
        lock(&self.cut[pool.index()])
            .get_or_insert_with(|| watch::Sender::new(false))
            .subscribe()
    }

    /// A relay to `target` for a link between `parties` (one pool, for the failover logic's link
    /// to it; two, for a link between the pools): its address.
    pub async fn relay(&self, parties: &[Pool], target: SocketAddr) -> std::io::Result<SocketAddr> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let cuts: Vec<_> = parties.iter().map(|p| self.cut_of(*p)).collect();
        lock(&self.relays).spawn(relay(listener, target, cuts));
        Ok(addr)
    }

    /// Cuts `pool` off (or joins it again): every link it is a party to.
    pub fn cut(&self, pool: Pool, cut: bool) {
        lock(&self.cut[pool.index()])
            .get_or_insert_with(|| watch::Sender::new(false))
            .send_replace(cut);
    }
}

/// Whether any of `cuts` is cut now.
fn is_cut(cuts: &[watch::Receiver<bool>]) -> bool {
    cuts.iter().any(|c| *c.borrow())
}

/// Until one of `cuts` is cut.
async fn until_cut(cuts: &mut [watch::Receiver<bool>]) {
    let waits = cuts.iter_mut().map(|c| {
        Box::pin(async move {
            let _ = c.wait_for(|cut| *cut).await;
        })
    });
    futures::future::select_all(waits).await;
}

/// Until none of `cuts` is cut.
async fn until_joined(cuts: &mut [watch::Receiver<bool>]) {
    for c in cuts.iter_mut() {
        let _ = c.wait_for(|cut| !*cut).await;
    }
}

async fn relay(listener: TcpListener, target: SocketAddr, cuts: Vec<watch::Receiver<bool>>) {
    let mut connections = JoinSet::new();
    loop {
        let Ok((mut inbound, _)) = listener.accept().await else {
            continue;
        };
        let mut cuts = cuts.clone();
        connections.spawn(async move {
            if !is_cut(&cuts)
                && let Ok(mut outbound) = TcpStream::connect(target).await
            {
                let _ = inbound.set_nodelay(true);
                let _ = outbound.set_nodelay(true);
                tokio::select! {
                    _ = copy_bidirectional(&mut inbound, &mut outbound) => return,
                    () = until_cut(&mut cuts) => {}
                }
            }
            // Cut: hold the connection, moving nothing, until the link is joined again.
            until_joined(&mut cuts).await;
        });
        // Reap the finished ones as we go.
        while connections.try_join_next().is_some() {}
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// Echoes every byte back.
    async fn echo() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    async fn round_trip(addr: SocketAddr) -> Option<[u8; 2]> {
        let mut s = TcpStream::connect(addr).await.ok()?;
        s.write_all(b"hi").await.ok()?;
        let mut got = [0; 2];
        tokio::time::timeout(Duration::from_millis(300), s.read_exact(&mut got))
            .await
            .ok()?
            .ok()?;
        Some(got)
    }

    #[tokio::test]
    async fn a_cut_link_moves_nothing_until_it_is_joined_and_other_links_are_untouched() {
        let target = echo().await;
        let links = Links::default();
        let between = links.relay(&[Pool::A, Pool::B], target).await.unwrap();
        let to_b = links.relay(&[Pool::B], target).await.unwrap();
        assert_eq!(round_trip(between).await, Some(*b"hi"));
        links.cut(Pool::A, true);
        assert_eq!(round_trip(between).await, None, "a link a is a party to is cut");
        assert_eq!(round_trip(to_b).await, Some(*b"hi"), "b's own link is not");
        links.cut(Pool::A, false);
        assert_eq!(round_trip(between).await, Some(*b"hi"));
    }
}
