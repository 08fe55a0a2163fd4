//! A listener for an endpoint that faces the internet: at most
//! `max_connections` connections at once (further clients wait in the
//! kernel's accept queue), and a connection on which the client neither sends
//! nor receives a byte for `idle_timeout` is closed. Together they bound what
//! clients that open connections and send nothing, or send their headers a
//! byte at a time, can hold: before a request reaches a handler, neither
//! hyper (without a timer) nor axum puts a limit on it.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::serve::Listener;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

pub(crate) struct GuardedListener {
    inner: TcpListener,
    slots: Arc<Semaphore>,
    idle_timeout: Duration,
}

impl GuardedListener {
    pub(crate) fn new(
        inner: TcpListener,
        max_connections: usize,
        idle_timeout: Duration,
    ) -> GuardedListener {
        GuardedListener {
            inner,
            slots: Arc::new(Semaphore::new(max_connections.max(1))),
            idle_timeout,
        }
    }
}

impl Listener for GuardedListener {
    type Io = GuardedIo;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (GuardedIo, SocketAddr) {
        let slot = Arc::clone(&self.slots)
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let (stream, addr) = Listener::accept(&mut self.inner).await;
        let io = GuardedIo {
            stream,
            _slot: slot,
            idle_timeout: self.idle_timeout,
            deadline: Box::pin(tokio::time::sleep(self.idle_timeout)),
        };
        (io, addr)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

/// A connection that holds one slot until it is dropped.
pub(crate) struct GuardedIo {
    stream: TcpStream,
    _slot: OwnedSemaphorePermit,
    idle_timeout: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl GuardedIo {
    /// `poll`, and the idle deadline moved on when it made progress.
    fn note<T>(&mut self, poll: Poll<T>) -> Poll<T> {
        if poll.is_ready() {
            let at = Instant::now() + self.idle_timeout;
            self.deadline.as_mut().reset(at);
        }
        poll
    }
}

impl AsyncRead for GuardedIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let read = Pin::new(&mut this.stream).poll_read(cx, buf);
        match this.note(read) {
            Poll::Ready(result) => Poll::Ready(result),
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client sent nothing for too long",
                ))),
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl AsyncWrite for GuardedIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.note(written)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.note(written)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// Serves `router` on `addr` through a [`GuardedListener`] until `shutdown`
/// resolves.
pub(crate) async fn serve(
    addr: SocketAddr,
    router: axum::Router,
    max_connections: usize,
    idle_timeout: Duration,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let listener = GuardedListener::new(listener, max_connections, idle_timeout);
    Ok((local, super::ops::spawn_server(listener, router, shutdown)))
}
