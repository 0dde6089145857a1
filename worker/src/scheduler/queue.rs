//! The admission queue's pure state: three priority levels with aging, so
//! that LOW is served before it starves, and a bound on its length.
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Scheduling priority of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Priority {
    High = 0,
    Normal = 1,
    Low = 2,
}

impl Priority {
    /// From the wire enum (unspecified is NORMAL).
    pub fn from_wire(p: i32) -> Self {
        match p {
            1 => Priority::High,
            3 => Priority::Low,
            _ => Priority::Normal,
        }
    }
}

/// A queue of items in three priority classes. A waiting item is promoted
/// one class for every `aging` it has waited, so a LOW request waits at most
/// about two `aging` periods behind a steady stream of HIGH ones.
#[derive(Debug)]
pub struct PriorityQueue<T> {
    classes: [VecDeque<(Instant, T)>; 3],
    aging: Duration,
}

impl<T> PriorityQueue<T> {
    /// An empty queue promoting waiting items every `aging`.
    pub fn new(aging: Duration) -> Self {
        Self {
            classes: Default::default(),
            aging,
        }
    }

    /// Adds an item that arrived at `at`.
    pub fn push(&mut self, priority: Priority, at: Instant, item: T) {
        self.classes[priority as usize].push_back((at, item));
    }

    /// Puts an item back at the head of its class (a preempted sequence goes
    /// before those that arrived after it).
    pub fn push_front(&mut self, priority: Priority, at: Instant, item: T) {
        self.classes[priority as usize].push_front((at, item));
    }

    /// The next item to serve at time `now`: the head with the best effective
    /// class (its class minus one per `aging` waited), oldest first on ties.
    pub fn pop(&mut self, now: Instant) -> Option<T> {
        let best = (0..3)
            .filter_map(|c| self.classes[c].front().map(|(at, _)| (c, *at)))
            .min_by_key(|&(c, at)| (self.effective(c, at, now), at))?;
        self.classes[best.0].pop_front().map(|(_, item)| item)
    }

    fn effective(&self, class: usize, at: Instant, now: Instant) -> usize {
        if self.aging.is_zero() {
            return class;
        }
        let steps = (now.saturating_duration_since(at).as_nanos() / self.aging.as_nanos()) as usize;
        class.saturating_sub(steps)
    }

    /// Removes every item for which `gone` is true; returns how many.
    pub fn remove_where(&mut self, mut gone: impl FnMut(&T) -> bool) -> usize {
        let mut removed = 0;
        for c in &mut self.classes {
            let before = c.len();
            c.retain(|(_, item)| !gone(item));
            removed += before - c.len();
        }
        removed
    }

    /// Takes out every item for which `pick` is true, in queue order.
    pub fn take_where(&mut self, mut pick: impl FnMut(&T) -> bool) -> Vec<T> {
        let mut taken = Vec::new();
        for c in &mut self.classes {
            let (out, keep): (VecDeque<_>, VecDeque<_>) = std::mem::take(c)
                .into_iter()
                .partition(|(_, item)| pick(item));
            *c = keep;
            taken.extend(out.into_iter().map(|(_, item)| item));
        }
        taken
    }

    /// Items waiting.
    pub fn len(&self) -> usize {
        self.classes.iter().map(VecDeque::len).sum()
    }

    /// True when nothing waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Items waiting per class: HIGH, NORMAL, LOW.
    pub fn depths(&self) -> [usize; 3] {
        [
            self.classes[0].len(),
            self.classes[1].len(),
            self.classes[2].len(),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn higher_classes_first_then_arrival_order() {
        let t0 = Instant::now();
        let mut q = PriorityQueue::new(Duration::from_secs(10));
        q.push(Priority::Low, t0, "low");
        q.push(Priority::Normal, t0, "n1");
        q.push(Priority::High, t0 + Duration::from_millis(1), "high");
        q.push(Priority::Normal, t0 + Duration::from_millis(2), "n2");
        let now = t0 + Duration::from_millis(3);
        let order: Vec<_> = std::iter::from_fn(|| q.pop(now)).collect();
        assert_eq!(order, vec!["high", "n1", "n2", "low"]);
    }

    #[test]
    fn low_is_never_starved() {
        let t0 = Instant::now();
        let aging = Duration::from_secs(1);
        let mut q = PriorityQueue::new(aging);
        q.push(Priority::Low, t0, "low");
        // A steady stream of HIGH requests arriving every 100 ms.
        let mut served_low_at = None;
        for i in 0..100u64 {
            let now = t0 + Duration::from_millis(100 * i);
            q.push(Priority::High, now, "high");
            if q.pop(now) == Some("low") {
                served_low_at = Some(now - t0);
                break;
            }
        }
        let waited = served_low_at.expect("LOW was served");
        assert!(
            waited <= 2 * aging + Duration::from_millis(100),
            "{waited:?}"
        );
    }

    #[test]
    fn preempted_items_go_back_to_the_head() {
        let t0 = Instant::now();
        let mut q = PriorityQueue::new(Duration::ZERO);
        q.push(Priority::Normal, t0, 1);
        q.push_front(Priority::Normal, t0, 0);
        assert_eq!(q.pop(t0), Some(0));
        assert_eq!(q.depths(), [0, 1, 0]);
        assert_eq!(q.remove_where(|&x| x == 1), 1);
        assert!(q.is_empty());
        q.push(Priority::Low, t0, 2);
        q.push(Priority::High, t0, 3);
        q.push(Priority::Low, t0, 4);
        assert_eq!(q.take_where(|&x| x != 3), vec![2, 4]);
        assert_eq!(q.depths(), [1, 0, 0]);
    }
}
