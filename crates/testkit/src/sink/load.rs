//! Load per destination at the webhook endpoint: when each request to a
//! destination (`/hook/<name>`, the path's first two segments) arrived and
//! how many were in flight at once, so a test can check a relay's limits
//! (requests per second, concurrency). [`SinkHandle::set_webhook_delay`]
//! holds each webhook answer, so requests overlap.
//!
//! [`SinkHandle::set_webhook_delay`]: super::SinkHandle::set_webhook_delay

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What one destination received.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DestinationLoad {
    /// When each request arrived, in order.
    pub arrivals: Vec<Instant>,
    /// The most requests in flight at once.
    pub max_in_flight: u32,
}

impl DestinationLoad {
    /// The most requests that arrived within any `window` (sliding).
    pub fn max_within(&self, window: Duration) -> usize {
        let mut start = 0;
        let mut most = 0;
        for (end, at) in self.arrivals.iter().enumerate() {
            while *at - self.arrivals[start] >= window {
                start += 1;
            }
            most = most.max(end + 1 - start);
        }
        most
    }
}

#[derive(Default)]
struct Dest {
    load: DestinationLoad,
    in_flight: u32,
}

#[derive(Default, Clone)]
pub(crate) struct Load(Arc<Mutex<HashMap<String, Dest>>>);

/// A request in flight; dropping it ends it.
pub(crate) struct InFlight {
    load: Load,
    dest: String,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(d) = self.load.0.lock().expect("load lock").get_mut(&self.dest) {
            d.in_flight -= 1;
        }
    }
}

/// `/hook/<name>` of a path.
fn destination(path: &str) -> String {
    path.split('/').take(3).collect::<Vec<_>>().join("/")
}

impl Load {
    pub(crate) fn arrived(&self, path: &str) -> InFlight {
        let dest = destination(path);
        let mut all = self.0.lock().expect("load lock");
        let d = all.entry(dest.clone()).or_default();
        d.load.arrivals.push(Instant::now());
        d.in_flight += 1;
        d.load.max_in_flight = d.load.max_in_flight.max(d.in_flight);
        InFlight {
            load: self.clone(),
            dest,
        }
    }

    pub(crate) fn of(&self, dest: &str) -> DestinationLoad {
        self.0
            .lock()
            .expect("load lock")
            .get(dest)
            .map(|d| d.load.clone())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_busiest_window_is_counted() {
        let t = Instant::now();
        let load = DestinationLoad {
            arrivals: [0, 100, 900, 1000, 1100, 1950]
                .map(|ms| t + Duration::from_millis(ms))
                .to_vec(),
            max_in_flight: 1,
        };
        // A window is half open: [0, 1000) holds 0, 100, 900; [1000, 2000)
        // holds 1000, 1100, 1950; none of one second holds four.
        let most = |ms| load.max_within(Duration::from_millis(ms));
        assert_eq!(most(1000), 3);
        assert_eq!(most(1101), 5, "[0, 1101) holds 0 to 1100");
        assert_eq!(most(201), 3, "[900, 1101) holds 900, 1000, 1100");
        assert_eq!(most(200), 2, "1100 is 200 ms after 900");
        assert_eq!(most(100), 1);
        assert_eq!(destination("/hook/order.placed/x"), "/hook/order.placed");
    }
}
