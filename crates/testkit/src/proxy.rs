//! A loopback TCP proxy in front of a server (PostgreSQL, in the tests), that
//! can stop forwarding the connections open through it while keeping their
//! sockets open: what a relay sees of a database behind a network that
//! silently drops its packets (a half-open connection). Bytes sent into a
//! blackholed connection are read and thrown away, so the sender's writes
//! complete and nothing ever answers; connections made later forward
//! normally, as after a failover or a route that came back.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

/// A proxy on a free loopback port; stops (closing every connection) when dropped.
pub struct Proxy {
    addr: SocketAddr,
    url: String,
    links: Arc<Mutex<Vec<Arc<Link>>>>,
    opened: Arc<AtomicUsize>,
    accept: tokio::task::JoinHandle<()>,
}

/// One client connection and its upstream.
struct Link {
    blackholed: AtomicBool,
    closed: AtomicBool,
}

impl Proxy {
    /// A proxy in front of the server `url` (a `postgres://` URL) names; its
    /// [`Proxy::url`] is the same URL through the proxy.
    pub async fn in_front_of(url: &str) -> std::io::Result<Proxy> {
        let (before, authority, after) = split_authority(url);
        let (userinfo, hostport) = match authority.rsplit_once('@') {
            Some((u, h)) => (format!("{u}@"), h),
            None => (String::new(), authority),
        };
        let upstream = if hostport.contains(':') {
            hostport.to_owned()
        } else {
            format!("{hostport}:5432")
        };
        let listener = TcpListener::bind(("127.0.0.1", 0)).await?;
        let addr = listener.local_addr()?;
        let links: Arc<Mutex<Vec<Arc<Link>>>> = Arc::default();
        let opened = Arc::new(AtomicUsize::new(0));
        let accept = tokio::spawn(accept_forever(
            listener,
            upstream,
            Arc::clone(&links),
            Arc::clone(&opened),
        ));
        Ok(Proxy {
            addr,
            url: format!("{before}{userinfo}{addr}{after}"),
            links,
            opened,
            accept,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The server's URL through the proxy.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Every connection open now stops forwarding, both ways; their sockets
    /// stay open. How many that was.
    pub fn blackhole_open(&self) -> usize {
        let links = self.links.lock().expect("proxy links");
        let mut n = 0;
        for link in links.iter().filter(|l| !l.closed.load(Ordering::SeqCst)) {
            link.blackholed.store(true, Ordering::SeqCst);
            n += 1;
        }
        n
    }

    /// Connections open now that still forward.
    pub fn forwarding(&self) -> usize {
        let links = self.links.lock().expect("proxy links");
        links
            .iter()
            .filter(|l| !l.closed.load(Ordering::SeqCst) && !l.blackholed.load(Ordering::SeqCst))
            .count()
    }

    /// Connections accepted since the start.
    pub fn opened(&self) -> usize {
        self.opened.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        // The accept task owns the links' tasks: aborting it closes them all.
        self.accept.abort();
    }
}

/// `scheme://` and what comes before the authority, the authority, the rest.
fn split_authority(url: &str) -> (&str, &str, &str) {
    let start = url.find("://").map_or(0, |i| i + 3);
    let end = url[start..]
        .find(['/', '?'])
        .map_or(url.len(), |i| start + i);
    (&url[..start], &url[start..end], &url[end..])
}

async fn accept_forever(
    listener: TcpListener,
    upstream: String,
    links: Arc<Mutex<Vec<Arc<Link>>>>,
    opened: Arc<AtomicUsize>,
) {
    let mut tasks = JoinSet::new();
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        let Ok(server) = TcpStream::connect(&upstream).await else {
            continue;
        };
        opened.fetch_add(1, Ordering::SeqCst);
        let link = Arc::new(Link {
            blackholed: AtomicBool::new(false),
            closed: AtomicBool::new(false),
        });
        {
            let mut links = links.lock().expect("proxy links");
            links.retain(|l| !l.closed.load(Ordering::SeqCst));
            links.push(Arc::clone(&link));
        }
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        tasks.spawn(forward(client, server, link));
        // Reap the links that ended.
        while tasks.try_join_next().is_some() {}
    }
}

/// Copies both ways until either side closes, throwing the bytes away once
/// the link is blackholed.
async fn forward(client: TcpStream, server: TcpStream, link: Arc<Link>) {
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::select! {
        _ = pump(client_read, server_write, &link) => {}
        _ = pump(server_read, client_write, &link) => {}
    }
    link.closed.store(true, Ordering::SeqCst);
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    link: &Link,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if link.blackholed.load(Ordering::SeqCst) {
            continue;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::split_authority;

    #[test]
    fn the_authority_is_found_with_or_without_a_path_or_query() {
        assert_eq!(
            split_authority("postgres://u@127.0.0.1:5/db?x=1"),
            ("postgres://", "u@127.0.0.1:5", "/db?x=1")
        );
        assert_eq!(split_authority("postgres://h"), ("postgres://", "h", ""));
    }
}
