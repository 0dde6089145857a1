//! The client's stream, produced in the task that sends it (issue 20).
//!
//! The failover relay was a spawned task feeding a channel that the server's
//! stream task read: every token woke two tasks on the router instead of
//! one. A [`Pump`] instead holds the relay's future and polls it whenever the
//! server asks for the next message, so a token goes from the worker's
//! stream to the client's in one poll. The relay hands each message over
//! through a one-message slot ([`Outbox`]); the server taking the message is
//! what lets the relay go on, which is the backpressure the channel gave.
//!
//! A client that goes away drops the server's stream, and with it the
//! `Pump`, the relay's future and the worker's stream: the worker frees the
//! sequence as it did when the relay's task noticed the closed channel.
use futures::Stream;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

/// One message in hand between the relay and the stream.
type Slot<T> = Arc<Mutex<Option<T>>>;

/// The relay's end: where it puts the client's next message.
pub struct Outbox<T> {
    slot: Slot<T>,
}

impl<T> Outbox<T> {
    /// Hands `item` to the client's stream; resolves once the stream has
    /// taken the message before it (at most one waits).
    pub async fn send(&self, item: T) {
        let mut item = Some(item);
        std::future::poll_fn(|_| {
            let mut slot = self.slot.lock().expect("pump slot");
            if slot.is_some() {
                // Only the Pump polls this future, and it polls again as
                // soon as it has taken the message in the slot: no waker.
                return Poll::Pending;
            }
            *slot = item.take();
            Poll::Ready(())
        })
        .await;
    }
}

/// A stream of what a relay future sends to its [`Outbox`], polled in the
/// consumer's task.
pub struct Pump<T> {
    relay: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    slot: Slot<T>,
}

impl<T: Send + 'static> Pump<T> {
    /// A stream of the messages `relay` sends to the outbox it is given.
    pub fn new<F, Fut>(relay: F) -> Self
    where
        F: FnOnce(Outbox<T>) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let slot: Slot<T> = Arc::new(Mutex::new(None));
        let outbox = Outbox { slot: slot.clone() };
        Self {
            relay: Some(Box::pin(relay(outbox))),
            slot,
        }
    }

    fn take(&self) -> Option<T> {
        self.slot.lock().expect("pump slot").take()
    }
}

impl<T: Send + 'static> Stream for Pump<T> {
    type Item = T;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let this = self.get_mut();
        if let Some(item) = this.take() {
            return Poll::Ready(Some(item));
        }
        let Some(relay) = this.relay.as_mut() else {
            return Poll::Ready(None);
        };
        let done = relay.as_mut().poll(cx).is_ready();
        if done {
            // Dropped at once: it holds the worker's stream and the
            // admission slot.
            this.relay = None;
        }
        match this.take() {
            Some(item) => Poll::Ready(Some(item)),
            None if done => Poll::Ready(None),
            None => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use std::sync::atomic::{AtomicBool, Ordering};

    #[tokio::test]
    async fn every_message_arrives_in_order_then_the_end() {
        let pump = Pump::new(|out| async move {
            for i in 0..5 {
                // Two in one poll: the second waits for the first to be taken.
                out.send(i).await;
                out.send(i + 100).await;
            }
        });
        let got: Vec<i32> = pump.collect().await;
        assert_eq!(got, vec![0, 100, 1, 101, 2, 102, 3, 103, 4, 104]);
    }

    #[tokio::test]
    async fn the_relay_waits_for_its_source_in_the_consumer_s_task() {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<u32>(4);
        let mut pump = Pump::new(|out| async move {
            while let Some(v) = rx.recv().await {
                out.send(v).await;
            }
        });
        let next = tokio::spawn(async move {
            let first = pump.next().await;
            (first, pump.next().await, pump.next().await)
        });
        tx.send(7).await.unwrap();
        tx.send(8).await.unwrap();
        drop(tx);
        assert_eq!(next.await.unwrap(), (Some(7), Some(8), None));
    }

    #[tokio::test]
    async fn dropping_the_stream_drops_the_relay() {
        struct Flag(Arc<AtomicBool>);
        impl Drop for Flag {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let dropped = Arc::new(AtomicBool::new(false));
        let flag = Flag(dropped.clone());
        let mut pump = Pump::new(|out| async move {
            let _flag = flag;
            out.send(1).await;
            std::future::pending::<()>().await;
        });
        assert_eq!(pump.next().await, Some(1));
        assert!(!dropped.load(Ordering::SeqCst), "still relaying");
        drop(pump);
        assert!(
            dropped.load(Ordering::SeqCst),
            "the relay went with the stream"
        );
    }
}
