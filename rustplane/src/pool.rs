//! Per-thread session pools, and the lease of a session, for both databases (`pg`, `mysql`).
//!
//! Hand-off is first come, first served: a session given back goes straight to the call that has waited
//! longest, never to a call that arrived after it (with a plain idle list and a wake-up, a new call could
//! take the session before the woken one ran, and an unlucky call could wait through many hand-offs: the
//! tail latency of an open-loop run when the pool is the bottleneck). A `Lease` goes back to its pool when
//! dropped, unless its session broke or was dropped mid-exchange (then it is closed and its place freed).

use crate::error::ExecError;
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::thread::LocalKey;
use tokio::sync::oneshot;

/// What a waiting call is given: a session, or the right to open one (a place freed by a closed session).
enum Grant<S> {
    Session(S),
    Open,
}

/// What `acquire` found.
enum Acquired<S> {
    /// An idle session (the caller checks it is still usable, else `closed()` and acquires again).
    Idle(S),
    /// A place to open a new session: the caller connects, and calls `closed()` if that fails.
    Open,
    /// Every place is taken: wait for a grant in arrival order.
    Wait(oneshot::Receiver<Grant<S>>),
}

struct Slots<S> {
    idle: Vec<S>,
    /// sessions open (idle or leased) plus places granted for opening
    open: usize,
    cap: usize,
    waiters: VecDeque<oneshot::Sender<Grant<S>>>,
}

impl<S> Slots<S> {
    fn new(cap: usize) -> Slots<S> {
        Slots { idle: Vec::new(), open: 0, cap: cap.max(1), waiters: VecDeque::new() }
    }

    fn acquire(&mut self) -> Acquired<S> {
        self.waiters.retain(|w| !w.is_closed());
        if self.waiters.is_empty() {
            if let Some(s) = self.idle.pop() {
                return Acquired::Idle(s);
            }
            if self.open < self.cap {
                self.open += 1;
                return Acquired::Open;
            }
        }
        let (tx, rx) = oneshot::channel();
        self.waiters.push_back(tx);
        Acquired::Wait(rx)
    }

    /// A healthy session comes back: to the longest waiter, else idle.
    fn release(&mut self, mut s: S) {
        while let Some(w) = self.waiters.pop_front() {
            match w.send(Grant::Session(s)) {
                Ok(()) => return,
                Err(Grant::Session(back)) => s = back, // that caller gave up: the next one
                Err(Grant::Open) => unreachable!("a session was sent"),
            }
        }
        self.idle.push(s);
    }

    /// Every idle session, taken out (the caller closes each and calls `closed()` for it).
    fn take_idle(&mut self) -> Vec<S> {
        std::mem::take(&mut self.idle)
    }

    /// A session closed (or could not be opened): its place goes to the longest waiter, else is free.
    fn closed(&mut self) {
        while let Some(w) = self.waiters.pop_front() {
            if w.send(Grant::Open).is_ok() {
                return; // the waiter opens a session in this place: `open` stays counted
            }
        }
        self.open -= 1;
    }
}

/// A database session a pool can hold: how one is opened, whether it may serve another call, how it is
/// closed. `pg::Session` and `mysql::Session`; their statements' operations are methods of their `Lease`.
pub(crate) trait Pooled: Sized + 'static {
    /// Everything that defines a session; a changed spec (a changed connection entry) makes a new pool.
    type Spec: Clone + PartialEq;
    /// Open a session for this spec (bounded as a whole by the connection's connect timeout).
    async fn connect(spec: &Self::Spec) -> Result<Self, ExecError>;
    /// Healthy, not abandoned mid-exchange, still connected: it may go back to the pool and be leased.
    fn reusable(&self) -> bool;
    /// Close without waiting on the server.
    fn close(self);
}

/// Sessions per plane thread and connection: QAG_POOL_SIZE (default 8), as each Python worker keeps.
fn pool_cap() -> usize {
    std::env::var("QAG_POOL_SIZE").ok().and_then(|v| v.parse().ok()).filter(|n| *n > 0).unwrap_or(8)
}

/// One thread's sessions of one connection: at most `pool_cap()`, like a worker's pool.
pub(crate) struct Pool<S: Pooled> {
    spec: S::Spec,
    slots: Slots<S>,
}

impl<S: Pooled> Pool<S> {
    /// A pooled session turned out stale: the idle ones were opened before the same event (a restart
    /// ends them all), so they are closed now rather than each costing a caller a failed try.
    pub(crate) fn purge_idle(&mut self) {
        for s in self.slots.take_idle() {
            s.close();
            self.slots.closed();
        }
    }
}

/// A backend's pools on one thread, by connection name.
pub(crate) type Pools<S> = RefCell<HashMap<String, Rc<RefCell<Pool<S>>>>>;

/// The thread's pool of connection `name` for this spec; a pool made for another spec is replaced.
pub(crate) fn pool_for<S: Pooled>(pools: &'static LocalKey<Pools<S>>, name: &str, spec: &S::Spec) -> Rc<RefCell<Pool<S>>> {
    pools.with(|p| {
        let mut pools = p.borrow_mut();
        if let Some(pool) = pools.get(name) {
            if pool.borrow().spec == *spec {
                return pool.clone();
            }
        }
        let pool = Rc::new(RefCell::new(Pool { spec: spec.clone(), slots: Slots::new(pool_cap()) }));
        pools.insert(name.to_string(), pool.clone());
        pool
    })
}

/// Wait for a grant; a call dropped while waiting (its caller went away) gives back what it was granted.
async fn wait<S: Pooled>(pool: &Rc<RefCell<Pool<S>>>, rx: oneshot::Receiver<Grant<S>>) -> Option<Grant<S>> {
    struct Waiter<S: Pooled> {
        pool: Rc<RefCell<Pool<S>>>,
        rx: oneshot::Receiver<Grant<S>>,
    }
    impl<S: Pooled> Drop for Waiter<S> {
        fn drop(&mut self) {
            self.rx.close();
            if let Ok(g) = self.rx.try_recv() {
                let mut p = self.pool.borrow_mut();
                match g {
                    Grant::Session(s) => p.slots.release(s),
                    Grant::Open => p.slots.closed(),
                }
            }
        }
    }
    let mut w = Waiter { pool: pool.clone(), rx };
    (&mut w.rx).await.ok()
}

/// A place granted for opening a session, while the session is being opened: freed when dropped first.
struct Place<S: Pooled> {
    pool: Option<Rc<RefCell<Pool<S>>>>,
}

impl<S: Pooled> Place<S> {
    fn pool(&self) -> &Rc<RefCell<Pool<S>>> {
        self.pool.as_ref().expect("a place holds its pool until kept")
    }

    /// Connecting ended (either way): the caller accounts for the place from here.
    fn keep(mut self) -> Rc<RefCell<Pool<S>>> {
        self.pool.take().expect("a place is kept once")
    }
}

impl<S: Pooled> Drop for Place<S> {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.borrow_mut().slots.closed();
        }
    }
}

/// A checked-out session; goes back to its pool when dropped, unless it broke or was dropped mid-exchange.
pub(crate) struct Lease<S: Pooled> {
    pool: Rc<RefCell<Pool<S>>>,
    session: Option<S>,
    /// The session came from the pool (it may be stale) rather than being opened for this call.
    pub(crate) reused: bool,
}

impl<S: Pooled> Drop for Lease<S> {
    fn drop(&mut self) {
        let mut p = self.pool.borrow_mut();
        match self.session.take() {
            Some(s) if s.reusable() => p.slots.release(s),
            Some(s) => {
                s.close(); // a PostgreSQL session's connection task is aborted: the socket closes now
                p.slots.closed(); // closed, broken or abandoned mid-exchange: its place is free again
            }
            None => p.slots.closed(),
        }
    }
}

impl<S: Pooled> Lease<S> {
    /// An idle session, a new one in a free place, or the first one given back (in arrival order).
    pub(crate) async fn get(pool: Rc<RefCell<Pool<S>>>) -> Result<Lease<S>, ExecError> {
        loop {
            let acquired = pool.borrow_mut().slots.acquire();
            let grant = match acquired {
                Acquired::Idle(s) => Grant::Session(s),
                Acquired::Open => Grant::Open,
                Acquired::Wait(rx) => match wait(&pool, rx).await {
                    Some(g) => g,
                    None => continue,
                },
            };
            match grant {
                Grant::Session(s) if s.reusable() => return Ok(Lease { pool, session: Some(s), reused: true }),
                Grant::Session(s) => {
                    s.close();
                    pool.borrow_mut().slots.closed();
                }
                Grant::Open => {
                    // The place is this call's until it holds a session: given back if connecting fails, and
                    // also if the call is dropped while connecting (its client went away, the deadline fired),
                    // else the place would stay counted with no session in it, and once every place had gone
                    // that way each later call would wait forever.
                    let place = Place { pool: Some(pool) };
                    let spec = place.pool().borrow().spec.clone();
                    let connected = S::connect(&spec).await;
                    let pool = place.keep();
                    return match connected {
                        Ok(session) => Ok(Lease { pool, session: Some(session), reused: false }),
                        Err(e) => {
                            pool.borrow_mut().slots.closed();
                            Err(e)
                        }
                    };
                }
            }
        }
    }

    /// The leased session (a lease holds it until dropped).
    pub(crate) fn session(&self) -> &S {
        self.session.as_ref().expect("a lease holds its session until dropped")
    }

    pub(crate) fn session_mut(&mut self) -> &mut S {
        self.session.as_mut().expect("a lease holds its session until dropped")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_come_first_served() {
        let mut p: Slots<u32> = Slots::new(1);
        assert!(matches!(p.acquire(), Acquired::Open));
        let Acquired::Wait(mut first) = p.acquire() else { panic!("pool full: wait") };
        let Acquired::Wait(mut second) = p.acquire() else { panic!("pool full: wait") };
        p.release(7);
        assert!(matches!(first.try_recv(), Ok(Grant::Session(7))), "the longest waiter gets the session");
        // a newcomer does not jump the queue while someone waits
        assert!(matches!(p.acquire(), Acquired::Wait(_)));
        p.closed();
        assert!(matches!(second.try_recv(), Ok(Grant::Open)), "a closed session's place goes to the next waiter");
        drop(first);
    }

    /// A session whose connect never finishes (a server that accepted and never answered).
    struct Never;

    impl Pooled for Never {
        type Spec = ();

        async fn connect(_: &()) -> Result<Never, ExecError> {
            std::future::pending().await
        }

        fn reusable(&self) -> bool {
            true
        }

        fn close(self) {}
    }

    #[test]
    fn a_call_dropped_while_connecting_frees_its_place() {
        let pool = Rc::new(RefCell::new(Pool::<Never> { spec: (), slots: Slots::new(1) }));
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            // the call connects in the one place and is dropped (its client went away) before it finishes
            let gave_up = tokio::time::timeout(std::time::Duration::from_millis(20), Lease::get(pool.clone())).await;
            assert!(gave_up.is_err());
        });
        assert!(matches!(pool.borrow_mut().slots.acquire(), Acquired::Open), "the place is free again, not leaked");
    }

    #[test]
    fn a_caller_that_gave_up_is_skipped() {
        let mut p: Slots<u32> = Slots::new(1);
        assert!(matches!(p.acquire(), Acquired::Open));
        let Acquired::Wait(gone) = p.acquire() else { panic!() };
        drop(gone);
        p.release(3);
        assert!(matches!(p.acquire(), Acquired::Idle(3)));
        p.closed();
        assert!(matches!(p.acquire(), Acquired::Open));
    }
}
