//! The limiters' admission, and the host entries' checks and matching.

use super::*;

fn limiter(rate: u32, concurrency: Option<u32>) -> Limiter {
    Limiter::new(
        "route `r`".into(),
        NonZeroU32::new(rate),
        None,
        concurrency.and_then(NonZeroU32::new),
    )
}

#[test]
fn sends_are_paced_and_the_rest_spread_over_later_slots() {
    let l = limiter(10, None);
    let now = Instant::now();
    let mut sent = Vec::new();
    let mut delays = Vec::new();
    for _ in 0..10 {
        match admit_one(&[&l], now) {
            Admission::Go(t) => sent.push(t.at - now),
            Admission::Wait { delay, .. } => delays.push(delay),
        }
    }
    // 100 ms apart, within the bounded wait: now, 100 ms, 200 ms.
    assert_eq!(sent, [0, 100, 200].map(Duration::from_millis));
    // The others come back one slot apart, not all at once.
    assert_eq!(delays.len(), 7);
    assert!(
        delays
            .windows(2)
            .all(|w| w[1] == w[0] + Duration::from_millis(100)),
        "{delays:?}"
    );
}

#[tokio::test]
async fn a_row_without_a_request_slot_queues_for_one_until_the_queue_is_full() {
    let l = limiter(1000, Some(1));
    let now = Instant::now();
    let Admission::Go(first) = admit_one(&[&l], now) else {
        panic!("the free slot")
    };
    assert!(!first.queued());
    // At the first guess of 10 ms a request, 250 ms serve 25 queued rows.
    let mut queued = Vec::new();
    for i in 0..25 {
        match admit_one(&[&l], now) {
            Admission::Go(t) => {
                assert!(t.queued(), "row {i} queues");
                queued.push(t);
            }
            Admission::Wait { .. } => panic!("row {i} deferred with room in the queue"),
        }
    }
    let full = admit_one(&[&l], now);
    assert!(
        matches!(&full, Admission::Wait { error, .. } if error.contains("queue for them is full")),
        "{full:?}"
    );
    // The slot goes to the first in the queue when it frees; the next waits.
    let mut second = queued.remove(0);
    let mut third = queued.remove(0);
    let waiting = tokio::spawn(async move {
        second.ready().await.unwrap();
        second
    });
    tokio::task::yield_now().await;
    assert!(!waiting.is_finished(), "no slot yet");
    drop(first);
    let second = waiting.await.unwrap();
    assert!(!second.queued());
    third.by = Some(Instant::now() + Duration::from_millis(50));
    let err = third.ready().await.unwrap_err();
    assert!(
        err.contains("route `r`") && err.contains("not sent"),
        "{err}"
    );
    // Leaving the queue (sent or not) makes room for another row.
    drop(third);
    drop(queued);
    assert!(matches!(admit_one(&[&l], now), Admission::Go(t) if t.queued()));
}

#[tokio::test]
async fn a_row_queued_on_two_limiters_goes_once_both_free() {
    // A row queued on its route's limiter queues on the host's too (one
    // order for every row), and goes once both free.
    let route = limiter(1000, Some(1));
    let host = limiter(1000, Some(1));
    let now = Instant::now();
    let Admission::Go(holder) = admit_one(&[&route, &host], now) else {
        panic!("free slots")
    };
    let Admission::Go(mut next) = admit_one(&[&route, &host], now) else {
        panic!("queued")
    };
    assert_eq!(next.queued.len(), 2);
    next.by = Some(Instant::now() + Duration::from_secs(5));
    let go = tokio::spawn(async move { next.ready().await });
    tokio::task::yield_now().await;
    drop(holder);
    go.await.unwrap().unwrap();
}

const SECOND: Duration = Duration::from_secs(1);

#[test]
fn host_entries_are_checked_and_name_the_key() {
    let host = |h: &str, rate, period, concurrency| HostLimit {
        host: h.into(),
        rate: NonZeroU32::new(rate),
        period,
        concurrency: NonZeroU32::new(concurrency),
    };
    let key = |hosts: &[HostLimit]| validate_hosts(hosts).map_err(|(i, k, _)| (i, k));
    assert_eq!(key(&[host("api.example.com", 5, None, 0)]), Ok(()));
    assert_eq!(
        key(&[host("https://api.example.com", 5, None, 0)]),
        Err((0, "host"))
    );
    assert_eq!(key(&[host("a", 0, None, 0)]), Err((0, "rate")));
    assert_eq!(
        key(&[host("a", 0, Some(DEFAULT_PERIOD), 2)]),
        Err((0, "period"))
    );
    assert_eq!(
        key(&[host("a", 1, None, 0), host("A", 2, None, 0)]),
        Err((1, "host"))
    );
}

fn at(host: &str, port: u16) -> HostPort {
    HostPort {
        host: host.into(),
        port: Some(port),
    }
}

#[test]
fn a_429_blocks_its_own_destination_only() {
    let limits = Limits::default();
    let now = Instant::now();
    assert!(limits.block(&at("127.0.0.1", 4001), now + Duration::from_secs(4)));
    let blocked = limits.host(&at("127.0.0.1", 4001)).expect("blocked");
    assert!(matches!(
        admit_one(&[&blocked], now),
        Admission::Wait { .. }
    ));
    // Another port of the same address is another destination.
    assert!(limits.host(&at("127.0.0.1", 4002)).is_none());
    // A shorter wait asked later does not shorten it; the block ends.
    assert!(!limits.block(&at("127.0.0.1", 4001), now + SECOND));
    assert!(matches!(
        admit_one(&[&blocked], now + Duration::from_secs(5)),
        Admission::Go(_)
    ));
}

#[test]
fn a_host_entry_covers_its_ports_and_one_naming_a_port_comes_first() {
    let entry = |host: &str| HostLimit {
        host: host.into(),
        rate: NonZeroU32::new(1),
        period: None,
        concurrency: None,
    };
    let limits = Limits::new(
        &[],
        &[entry("API.example.com"), entry("api.example.com:8443")],
    );
    let name = |to: HostPort| limits.host(&to).map(|l| l.name.clone());
    assert_eq!(
        name(at("api.example.com", 443)).as_deref(),
        Some("host `api.example.com`")
    );
    assert_eq!(
        name(at("api.example.com", 8443)).as_deref(),
        Some("host `api.example.com:8443`")
    );
    assert_eq!(name(at("other.example.com", 443)), None);
    assert_eq!(HostPort::parse("[::1]:8080"), Some(at("[::1]", 8080)));
    assert_eq!(HostPort::parse("user@api.example.com"), None);
    assert_eq!(HostPort::parse("api.example.com:"), None);
}
