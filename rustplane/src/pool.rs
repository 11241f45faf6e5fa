//! Per-thread session pools with first-come-first-served hand-off: a session given back goes straight to
//! the call that has waited longest, never to a call that arrived after it (with a plain idle list and a
//! wake-up, a new call could take the session before the woken one ran, and an unlucky call could wait
//! through many hand-offs: the tail latency of an open-loop run when the pool is the bottleneck).

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use tokio::sync::oneshot;

/// What a waiting call is given: a session, or the right to open one (a place freed by a closed session).
pub enum Grant<S> {
    Session(S),
    Open,
}

/// What `acquire` found.
pub enum Acquired<S> {
    /// An idle session (the caller checks it is still usable, else `closed()` and acquires again).
    Idle(S),
    /// A place to open a new session: the caller connects, and calls `closed()` if that fails.
    Open,
    /// Every place is taken: wait for a grant in arrival order.
    Wait(oneshot::Receiver<Grant<S>>),
}

pub struct Slots<S> {
    idle: Vec<S>,
    /// sessions open (idle or leased) plus places granted for opening
    open: usize,
    cap: usize,
    waiters: VecDeque<oneshot::Sender<Grant<S>>>,
}

impl<S> Slots<S> {
    pub fn new(cap: usize) -> Slots<S> {
        Slots { idle: Vec::new(), open: 0, cap: cap.max(1), waiters: VecDeque::new() }
    }

    pub fn acquire(&mut self) -> Acquired<S> {
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
    pub fn release(&mut self, mut s: S) {
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
    pub fn take_idle(&mut self) -> Vec<S> {
        std::mem::take(&mut self.idle)
    }

    /// A session closed (or could not be opened): its place goes to the longest waiter, else is free.
    pub fn closed(&mut self) {
        while let Some(w) = self.waiters.pop_front() {
            if w.send(Grant::Open).is_ok() {
                return; // the waiter opens a session in this place: `open` stays counted
            }
        }
        self.open -= 1;
    }
}

/// A pool that keeps its sessions in `Slots`.
pub trait HasSlots<S> {
    fn slots(&mut self) -> &mut Slots<S>;
}

/// Wait for a grant; a call dropped while waiting (its caller went away) gives back what it was granted.
pub async fn wait<P: HasSlots<S>, S>(pool: &Rc<RefCell<P>>, rx: oneshot::Receiver<Grant<S>>) -> Option<Grant<S>> {
    struct Waiter<P: HasSlots<S>, S> {
        pool: Rc<RefCell<P>>,
        rx: oneshot::Receiver<Grant<S>>,
    }
    impl<P: HasSlots<S>, S> Drop for Waiter<P, S> {
        fn drop(&mut self) {
            self.rx.close();
            if let Ok(g) = self.rx.try_recv() {
                let mut p = self.pool.borrow_mut();
                match g {
                    Grant::Session(s) => p.slots().release(s),
                    Grant::Open => p.slots().closed(),
                }
            }
        }
    }
    let mut w = Waiter { pool: pool.clone(), rx };
    (&mut w.rx).await.ok()
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
